"""Names of the choices of a request that runs several sequences (SamplingParams.n, best_of)."""


def choice_request_id(request_id: str, index: int) -> str:
    """The id choice `index` of request `request_id` has between the processes: its tokens
    travel, are aborted and are re-queued under it. "#" is in no client id
    (gateway/validation.ID_PATTERN), so no other request has it."""
    return f"{request_id}#{index}"


def split_choice_request_id(choice_id: str) -> tuple[str, int] | None:
    """(request id, index) of a choice's id; None when `choice_id` names no choice."""
    request_id, sep, index = choice_id.rpartition("#")
    if not sep or not index.isdigit():
        return None
    return request_id, int(index)


def num_sequences(params) -> int:
    """Sequences a `kvgate.v1.SamplingParams` message asks for: best_of when set, else n."""
    return params.best_of or params.n or 1


def choice_ids(request_id: str, params) -> list[str]:
    """The ids of a queued request's choices: its own id when it runs one sequence."""
    count = num_sequences(params)
    if count == 1:
        return [request_id]
    return [choice_request_id(request_id, i) for i in range(count)]

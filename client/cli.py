"""The `kvgate` command: generate text or chat with a running gateway.

kvgate generate "Once upon a time" --max-tokens 64 --temperature 0
kvgate generate --message "system:You tell short stories." --message "user:A dragon story"
kvgate chat --system "You tell short stories."
kvgate bench load --num-requests 100 --request-rate 4   (bench/cli.py: every benchmark)
kvgate admin keys create --tenant acme   (client/admin.py: API keys, limits, usage in Redis)

`kvgate bench` and `kvgate admin` hand their words and flags to the `main` of bench.cli and
client.admin, imported by name only then: the client loads no Redis client, and depends on no
benchmark code (a client installed without bench/ says so when asked to bench).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

import grpc

from client.api import ChatSession, Completion, KvgateClient, sampling_params
from client.flags import add_connection_flags, client_from_args


def _unsigned(bits: int) -> Callable[[str], int]:
    """An argparse type: an integer the request's unsigned `bits`-bit field can hold."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not 0 <= value < 2**bits:
            raise argparse.ArgumentTypeError(f"must be in [0, {2**bits - 1}], got {value}")
        return value

    return parse


def _message(text: str) -> dict[str, str]:
    """ROLE:CONTENT; the gateway checks the role (system, user or assistant)."""
    role, colon, content = text.partition(":")
    if not colon or not role:
        raise argparse.ArgumentTypeError(f"--message must be ROLE:CONTENT, got {text!r}")
    return {"role": role, "content": content}


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-tokens", type=_unsigned(32), default=None, help="most tokens to generate"
    )
    parser.add_argument("--temperature", type=float, default=None, help="0: greedy (default 1)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=_unsigned(64), default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--priority", type=int, default=0, help="lower runs first")
    add_connection_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="Talk to a kvgate gateway.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete a text and print the completion")
    generate.add_argument("text", nargs="?", default="", help="the prompt")
    generate.add_argument(
        "--message",
        dest="messages",
        type=_message,
        action="append",
        default=[],
        metavar="ROLE:CONTENT",
        help="a message of a conversation to answer instead of a prompt (repeatable, in order; "
        "the gateway renders it with the model's chat template)",
    )
    _add_sampling_flags(generate)
    chat = commands.add_parser("chat", help="a chat REPL (Ctrl-C stops a reply, Ctrl-D quits)")
    chat.add_argument("--system", default="", help="system prompt")
    chat.add_argument("--session-id", default="", help="resume this session")
    _add_sampling_flags(chat)
    commands.add_parser(
        "bench", help="run a benchmark (kvgate bench --help lists them)", add_help=False
    )
    commands.add_parser(
        "admin",
        help="API keys, tenant limits and usage, in Redis (kvgate admin --help)",
        add_help=False,
    )
    return parser


def _params(args: argparse.Namespace) -> object:
    return sampling_params(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
    )


def run_generate(client: KvgateClient, args: argparse.Namespace) -> int:
    """Print the completion as it streams."""
    completion = Completion()
    stream = client.generate_stream(
        args.text, _params(args), messages=args.messages, priority=args.priority
    )
    for chunk in stream:
        completion.add(chunk)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.error_message:
            print(f"\nkvgate: {chunk.error_message}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if not completion.text and completion.finish_reason == "stop":
        # An instruction-tuned model given raw text often ends it at once.
        print(
            "kvgate: the completion is empty: the model stopped (end of sequence or a stop "
            "string) before any text; `kvgate chat` sends text through the model's chat template",
            file=sys.stderr,
        )
    return 0


def _stream_reply(session: ChatSession, content: str, args: argparse.Namespace) -> None:
    try:
        for response in session.send(content, _params(args), args.priority):
            sys.stdout.write(response.chunk.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(session.cancel().text + " [stopped]")
    sys.stdout.write("\n")


def run_chat(client: KvgateClient, args: argparse.Namespace) -> int:
    """Read a line, stream the reply, repeat; end the session on exit."""
    session = client.chat(system_prompt=args.system, session_id=args.session_id)
    try:
        while True:
            try:
                content = input("you> ").strip()
            except EOFError:
                break
            if content:
                sys.stdout.write("kvgate> ")
                _stream_reply(session, content, args)
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
        if session.session_id:
            client.end_session(session.session_id)
    print()
    return 0


# Commands whose code lives in a module of its own, imported by name when asked for.
COMMAND_MODULES = {"bench": "bench.cli", "admin": "client.admin"}


def run_command_module(command: str, argv: list[str]) -> int:
    """Runs `kvgate COMMAND argv` through the `main` of its module. Returns: the exit status."""
    try:
        module = importlib.import_module(COMMAND_MODULES[command])
    except ModuleNotFoundError as error:
        print(f"kvgate {command}: not installed here ({error})", file=sys.stderr)
        return 2
    return module.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in COMMAND_MODULES:
        return run_command_module(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        client = client_from_args(args)
    except ValueError as error:
        print(f"kvgate: {error}", file=sys.stderr)
        return 2
    with client:
        try:
            if args.command == "generate":
                return run_generate(client, args)
            return run_chat(client, args)
        except grpc.RpcError as error:
            # UNAVAILABLE is the gateway unreachable, or its answer (no executor, Redis down):
            # the details tell which.
            status = f"--target {args.target}: {error.code().name}: {error.details()}"
            print(f"kvgate: {status}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())

"""The rolling-restart bench pairs each turn after a move with the same chat's turn before it."""

from __future__ import annotations

from bench.scaling import Session, Turn, paired_ttft_ratios, record


def turn(number: int, executor: str, ttft_ms: float, session_id: str = "chat", ok=True) -> Turn:
    return Turn(0, number, session_id, ok, "OK", 10, 0, 4, executor, ttft_ms=ttft_ms)


def chat(*turns: Turn) -> Session:
    session = Session(0, [1, 2, 3], session_id="chat")
    for t in turns:
        record(session, t)
    return session


def test_a_move_pairs_with_the_turn_before_it_when_that_one_stayed():
    session = chat(turn(0, "a", 50.0), turn(1, "a", 10.0), turn(2, "b", 15.0), turn(3, "b", 9.0))
    assert [t.after_move for t in session.turns] == [False, False, True, False]
    assert paired_ttft_ratios([session]) == [1.5]


def test_no_pair_without_a_stayed_turn_before_the_move():
    # turn 0 has no history (the chat's first), so the move at turn 1 has nothing to pair with;
    # nor has a move right after a move, nor a move across a chat that started over
    first = chat(turn(0, "a", 50.0), turn(1, "b", 12.0), turn(2, "a", 11.0))
    assert [t.after_move for t in first.turns] == [False, True, True]
    over = chat(turn(0, "a", 50.0), turn(1, "a", 10.0), turn(2, "b", 12.0, session_id="new"))
    assert paired_ttft_ratios([first, over]) == []


def test_a_failed_turn_between_leaves_the_pair_to_the_turns_that_answered():
    session = chat(
        turn(0, "a", 50.0), turn(1, "a", 10.0), turn(2, "", 0.0, ok=False), turn(3, "b", 20.0)
    )
    assert paired_ttft_ratios([session]) == [2.0]

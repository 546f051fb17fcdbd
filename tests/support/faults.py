"""Faults injected into an instance through its `InstanceParts`, never the environment.

Each fault is an object of one of the seams an instance takes at construction:

* `ScriptedOutput` (a `SampleHook`): the engine writes a known text. Output
  position i of every request takes token i of the script (then end of
  sequence) in place of the sampled one; all else (stop checks, detokenizing,
  the transfer of a first token, parsing) runs as in service. Random weights
  never write a tool call; a script does.
* `DropMessages` (a `MessageFilter`): the notification pump drops the named
  control message types (``kv_register``, ``kv_offer``, ``kv_done``, ...) on
  arrival, as if the network had lost every one.
* `BreakPump` (a `MessageFilter`): the notification pump's thread dies on the
  arrival of a named control message type, as on an error nothing caught there.
* `StallWhileFileExists` (a `LoopGate`): the engine loop stops at the start of
  its next iteration while a file exists, as in a step that never ends.

`Faults` gathers them for one instance; in process it gives the `InstanceParts`
(`Faults.parts`), across processes the flags of the test launcher
(`tests.support.faulty_instance`, which serves as ``kvduplex serve`` does), and
`start_instance` starts an instance through that launcher when it has faults.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.common.model_source import load_tokenizer
from kvduplex.engine.request import Request
from kvduplex.instance.server import InstanceParts
from kvduplex.kvflow import messages as _flow_messages  # noqa: F401  (defines the flows' types)
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.notify import MessageFilter
from kvduplex.transport.notify import message_type
from kvduplex.transport.notify import message_type_of

logger = logging.getLogger(__name__)

LAUNCHER = "tests.support.faulty_instance"
"""The module that serves one instance with `Faults` (``python -m``)."""
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ScriptedOutput:
    """A `SampleHook`: output position i takes ``token_ids[i]``; past the script, the
    sampled token stands."""

    token_ids: tuple[int, ...]

    @classmethod
    def of_text(cls, text: str, model: str) -> ScriptedOutput:
        """`text` in `model`'s tokenizer (preset name or folder), then its end of sequence."""
        tokenizer = load_tokenizer(model)
        script = tokenizer.encode(text, add_special_tokens=False)
        return cls((*script, tokenizer.eos_token_ids[0]))

    def __call__(self, requests: list[Request], sampled: list[int]) -> list[int]:
        script = self.token_ids
        return [
            script[r.num_output_tokens] if r.num_output_tokens < len(script) else token
            for r, token in zip(requests, sampled, strict=True)
        ]


def known_message_types() -> list[str]:
    """The type tags of every control message the flows send, sorted (a codec knows every
    message class defined when it is built: the flows' module is imported above)."""
    return sorted(message_type_of(t) for t in MessageCodec().types)


@dataclass(frozen=True)
class DropMessages:
    """A `MessageFilter` that drops every message of `types` (type tags) on arrival."""

    types: frozenset[str]

    def __post_init__(self) -> None:
        known = known_message_types()
        unknown = self.types - set(known)
        if unknown:
            raise ValueError(f"no control message has the type {sorted(unknown)}; known: {known}")

    def __call__(self, msg: ControlMessage, sender: str) -> bool:
        if message_type(msg) not in self.types:
            return True
        logger.warning("fault: dropping %s from %s (xid=%s)", message_type(msg), sender, msg.xid)
        return False


class PumpBroken(RuntimeError):
    """What `BreakPump` raises on the notification pump's thread."""


@dataclass(frozen=True)
class BreakPump:
    """A `MessageFilter` that raises `PumpBroken` on a message of `types` (type tags),
    killing the pump thread that called it; others pass on to `then` (None: all pass)."""

    types: frozenset[str]
    then: DropMessages | None = None

    def __post_init__(self) -> None:
        unknown = self.types - set(known_message_types())
        if unknown:
            raise ValueError(f"no control message has the type {sorted(unknown)}")

    def __call__(self, msg: ControlMessage, sender: str) -> bool:
        if message_type(msg) in self.types:
            logger.warning("fault: the notification pump breaks on %s (xid=%s)",
                           message_type(msg), msg.xid)  # fmt: skip
            raise PumpBroken(f"fault: {message_type(msg)} from {sender} breaks the pump")
        return self.then is None or self.then(msg, sender)


@dataclass(frozen=True)
class StallWhileFileExists:
    """A `LoopGate`: the loop stops while a file exists at `path` (it looks every
    `poll_s`), and goes on once it is removed or the engine shuts down."""

    path: Path
    poll_s: float = 0.05

    def __call__(self, stopping: threading.Event) -> None:
        if not self.path.exists():
            return
        logger.warning("fault: engine loop stalled while %s exists", self.path)
        while self.path.exists() and not stopping.wait(self.poll_s):
            pass  # the stall itself
        logger.warning("fault: engine loop goes on (%s removed)", self.path)


@dataclass(frozen=True)
class Faults:
    """The faults of one instance; the default has none."""

    drop_messages: frozenset[str] = frozenset()
    """Control message types its notification pump drops on arrival."""
    stall_file: Path | None = None
    """While a file exists here, its engine loop stops."""
    scripted_output: str | None = None
    """The text its engine writes, whatever the model would."""
    break_pump_on: frozenset[str] = frozenset()
    """Control message types on whose arrival its notification pump's thread dies."""

    @property
    def is_empty(self) -> bool:
        """No fault: the instance runs as ``kvduplex serve``'s does."""
        return (
            not self.drop_messages and self.stall_file is None and self.scripted_output is None
            and not self.break_pump_on
        )  # fmt: skip

    def parts(self, model: str) -> InstanceParts:
        """The instance parts that inject these faults into an instance of `model`.
        ValueError for a message type no control message has."""
        return InstanceParts(
            sample_hook=(
                None
                if self.scripted_output is None
                else ScriptedOutput.of_text(self.scripted_output, model)
            ),
            loop_gate=None if self.stall_file is None else StallWhileFileExists(self.stall_file),
            message_filter=self._message_filter(),
        )

    def _message_filter(self) -> MessageFilter | None:
        drop = DropMessages(self.drop_messages) if self.drop_messages else None
        return BreakPump(self.break_pump_on, drop) if self.break_pump_on else drop

    def flags(self) -> list[str]:
        """These faults as the launcher's flags (`from_args` reads them back); ``--flag=value``,
        so that a value may start with a dash."""
        out: list[str] = []
        if self.drop_messages:
            out.append(f"--drop-messages={','.join(sorted(self.drop_messages))}")
        if self.stall_file is not None:
            out.append(f"--stall-file={self.stall_file}")
        if self.scripted_output is not None:
            out.append(f"--scripted-output={self.scripted_output}")
        if self.break_pump_on:
            out.append(f"--break-pump-on={','.join(sorted(self.break_pump_on))}")
        return out

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--drop-messages", default="", metavar="TYPE[,TYPE...]",
            help="control message types the notification pump drops on arrival",
        )  # fmt: skip
        parser.add_argument(
            "--stall-file", default=None, metavar="PATH",
            help="the engine loop stops while a file exists at PATH",
        )  # fmt: skip
        parser.add_argument(
            "--scripted-output", default=None, metavar="TEXT", help="the text the engine writes"
        )
        parser.add_argument(
            "--break-pump-on", default="", metavar="TYPE[,TYPE...]",
            help="control message types on whose arrival the notification pump's thread dies",
        )  # fmt: skip

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Faults:
        """The faults `add_flags`'s flags name."""
        return cls(
            drop_messages=frozenset(_split(args.drop_messages)),
            stall_file=None if args.stall_file is None else Path(args.stall_file),
            scripted_output=args.scripted_output,
            break_pump_on=frozenset(_split(args.break_pump_on)),
        )


def _split(text: str) -> Iterable[str]:
    return (t.strip() for t in text.split(",") if t.strip())


def start_instance(
    cluster: LocalCluster,
    name: str,
    args: list[str],
    port: int,
    faults: Faults | None = None,
    env: dict[str, str] | None = None,
) -> Process:
    """`cluster.start` an instance (`args`: ``serve`` and its flags). With `faults`, through
    the test launcher, which serves as ``kvduplex serve`` does with those faults in; without,
    ``kvduplex`` itself."""
    if faults is None or faults.is_empty:
        return cluster.start(name, args, port, env=env)
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    launcher_env = {**(env or {}), "PYTHONPATH": path}  # the launcher is in this repository
    return cluster.start(name, [*faults.flags(), *args], port, env=launcher_env, module=LAUNCHER)

"""The settings models of ``kvduplex serve``, ``router`` and ``up``, one per process.

Each is made of the config sections that process runs with, so that a section's field
is a flag, an environment variable and a config-file key of every command that takes
it (`kvduplex.common.settings` reads them, flag > environment > file > default), and
the configs the process runs with are built from it again, checked by their sections.
"""

from __future__ import annotations

import enum
from typing import ClassVar
from typing import Literal

from pydantic import Field

from kvduplex.common.config import Port
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.engine_config import TransferConfig
from kvduplex.common.openai.parsing_config import ParsingConfig
from kvduplex.common.settings import ProcessSettings
from kvduplex.common.settings import StrArgs
from kvduplex.instance.config import ServerConfig
from kvduplex.router.config import RouterConfig
from kvduplex.router.config import RouterTuning


class ServeSettings(
    ModelLoadConfig, CacheConfig, SchedulerConfig, TransferConfig, ServerConfig, ProcessSettings
):
    """Serve one instance: a model, its paged KV cache and scheduler, the OpenAI API, and
    (as prefill or decode) the KV transfers to its peers."""

    command: ClassVar[str] = "serve"

    def engine_config(self) -> EngineConfig:
        """What the engine runs with."""
        return EngineConfig(
            model=self.section(ModelLoadConfig),
            cache=self.section(CacheConfig),
            scheduler=self.section(SchedulerConfig),
            transfer=self.section(TransferConfig),
        )

    def server_config(self) -> ServerConfig:
        """What the HTTP server runs with, its parsers included."""
        return self.section(ServerConfig)


class RouterSettings(RouterConfig, ProcessSettings):
    """Route OpenAI requests to prefill and decode instances."""

    command: ClassVar[str] = "router"

    prefill: StrArgs = Field(default=(), description=RouterConfig.model_fields["prefill"].description)
    decode: StrArgs = Field(default=(), description=RouterConfig.model_fields["decode"].description)

    def router_config(self) -> RouterConfig:
        """What the router runs with, its parsers included."""
        return self.section(RouterConfig)


class UpSettings(RouterTuning, ParsingConfig, ProcessSettings):
    """Start prefill, decode and a router locally on a built-in model, and run a demo
    session through them. The router tuning and parsing flags are handed on to the
    routers it starts (the parsing flags to the colocated instance)."""

    command: ClassVar[str] = "up"

    mode: Literal["push", "pull", "colocated"] = "push"
    """push (layer-wise, default), pull, or one colocated instance."""
    model: str = "small"
    """A preset or local Hugging Face folder."""
    dtype: str = ""
    """Model dtype (empty: auto)."""
    port: Port = 0
    """Front-door port (0: a free one)."""
    demo_turns: int = 6
    """Turns of the demo session; 0 skips it."""
    demo_max_tokens: int = 64
    """Tokens per answer."""
    demo_first_turn_tokens: int = 1200
    """The first turn's prompt, in tokens of the built-in byte tokenizer."""
    demo_turn_tokens: int = 120
    """Each later turn's new input, in tokens."""
    demo_think_s: float = 1.0
    """The client's pause before each later turn (the duplex return lands in it)."""
    seed: int = 0
    """Seed of the demo session."""
    keep_serving: bool = False
    """Keep serving after the demo."""
    kv_store: bool = False
    """Also start a Mooncake store (its master and one storage node holding kv_store_gib)
    and put every instance's KV tier on it (--kv-tier store): blocks one instance demoted,
    another loads. Needs pip install 'kvduplex[store]'."""
    kv_store_gib: float = Field(default=1.0, gt=0)
    """Memory of the store's storage node, in GiB (with kv_store)."""
    start_timeout: float = 300.0
    """Seconds to wait for health."""
    log_dir: str = ""
    """Where process logs go (empty: a temp dir)."""
    log_level: str = "warning"
    """Python log level."""

    def router_flags(self) -> list[str]:
        """The router tuning fields as flags of ``kvduplex router``."""
        out: list[str] = []
        for name in RouterTuning.model_fields:
            value, flag = getattr(self, name), name.replace("_", "-")
            if isinstance(value, bool):  # a switch: --flag / --no-flag
                out.append(f"--{flag}" if value else f"--no-{flag}")
                continue
            out += ["--" + flag, str(value.value if isinstance(value, enum.Enum) else value)]
        return out


def parsing_flags(parsing: ParsingConfig) -> list[str]:
    """`parsing` as the flags of a child ``serve`` or ``router``."""
    out: list[str] = []
    if parsing.tool_call_parser:
        out += ["--tool-call-parser", parsing.tool_call_parser]
    if parsing.reasoning_parser:
        out += ["--reasoning-parser", parsing.reasoning_parser]
    if parsing.enable_auto_tool_choice:
        out.append("--enable-auto-tool-choice")
    return out

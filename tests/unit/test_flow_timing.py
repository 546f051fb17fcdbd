"""The flows' deadlines as an instance derives them from its settings."""

from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.engine_config import TransferConfig
from kvduplex.instance.server import flow_timing


def test_a_fetched_layer_is_waited_for_under_the_engines_stall_limit() -> None:
    # the engine thread blocks on that wait: a hung READ must fail the load (the request
    # computes the history) before the engine would count as stalled
    timing = flow_timing(
        EngineConfig(
            transfer=TransferConfig(transfer_timeout_s=10.0),
            scheduler=SchedulerConfig(engine_stall_timeout_s=8.0),
        )
    )
    assert timing.layer_load_s == 4.0
    assert timing.transfer_timeout_s == 10.0
    assert timing.quarantine_s == 21.0  # two deadlines and a second
    quick = flow_timing(EngineConfig(transfer=TransferConfig(transfer_timeout_s=1.0)))
    assert quick.layer_load_s == 1.0  # never longer than one transfer's deadline

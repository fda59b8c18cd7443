"""pytest plugin (`-p torchft_wrap_plugin`): every `ProcessGroupGloo()` torchft's
integration tests build becomes `zeropp.ft.wrap(ProcessGroupGloo(), codec)`, codec
from ZEROPP_FT_CODEC (default int8), block size from ZEROPP_FT_BLOCK (default 16:
the tests' models are tiny, and a tensor under about a block per rank goes exact, as
fp32 is then fewer bytes). Loaded before collection, so the tests' own
`from torchft.process_group import ProcessGroupGloo` picks up the wrapped one."""

import os

import torchft.process_group as tpg

import zeropp.ft

_Gloo = tpg.ProcessGroupGloo
CODEC = os.environ.get("ZEROPP_FT_CODEC", "int8")
BLOCK = int(os.environ.get("ZEROPP_FT_BLOCK", "16"))
WRAPPED = []


def _wrapped_gloo(*args, **kwargs):
    pg = zeropp.ft.wrap(_Gloo(*args, **kwargs), CODEC, block_size=BLOCK)
    WRAPPED.append(pg)
    return pg


tpg.ProcessGroupGloo = _wrapped_gloo


def pytest_terminal_summary(terminalreporter):
    quantized = sum(zeropp.comm_stats(pg)["by_op"].get("allreduce/scatter", {}).get("calls", 0)
                    for pg in WRAPPED)
    exact = sum(zeropp.comm_stats(pg)["by_op"].get("allreduce/exact", {}).get("calls", 0)
                for pg in WRAPPED)
    terminalreporter.write_line(f"zeropp.ft.wrap({CODEC}, block_size={BLOCK}): {len(WRAPPED)} groups wrapped, "
                                f"{quantized} quantized all-reduces, {exact} exact")

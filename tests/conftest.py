"""The order files run in. `make test` runs two xdist workers, a file at a time each
(--dist loadfile), handing out files in collection order: the longest files go
first (measured with --durations=0, 2026-12-06: 88 s down to 37 s each), so that the last file
a worker takes is a short one and both finish together."""

from pathlib import Path

LONGEST_FIRST = ["fsdp2/test_fsdp2_nd.py", "engine/test_compile.py", "fsdp2/test_fsdp2.py",
                 "apps/test_cluster.py", "apps/test_replicas.py", "deepspeed/test_deepspeed_api.py",
                 "engine/test_zeropp.py", "deepspeed/test_hf_deepspeed.py",
                 "apps/test_train_cli.py", "apps/test_launch.py", "engine/test_gathered.py",
                 "comm/test_kernels.py", "deepspeed/test_hf_trl.py"]
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).resolve().relative_to(_HERE)
                                         .as_posix(), len(rank)))

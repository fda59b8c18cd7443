"""The order files run in. `make test` runs two xdist workers, a file at a time each
(--dist loadfile), handing out files in collection order (--no-loadscope-reorder: by
default xdist sorts files by their number of tests, which put a 36 s file of 3 tests
last and left one worker idle for its last 40 s): the longest files go first (seconds
each in one `make test`, 2026-12-06: 71 down to 27), so that the last file a worker
takes is a short one and both finish together."""

from pathlib import Path

LONGEST_FIRST = ["apps/test_replicas.py", "apps/test_cluster.py",
                 "deepspeed/test_hf_deepspeed.py", "deepspeed/test_deepspeed_api.py", "fsdp2/test_fsdp2_nd.py",
                 "apps/test_train_cli.py", "apps/test_launch.py", "fsdp2/test_fsdp2.py",
                 "engine/test_zeropp.py", "engine/test_compile.py", "engine/test_gathered.py",
                 "deepspeed/test_hf_trl.py", "engine/test_zero3_parity.py",
                 "deepspeed/test_alias.py", "engine/test_checkpoint.py",
                 "engine/test_zeropp_plus.py"]
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).resolve().relative_to(_HERE)
                                         .as_posix(), len(rank)))

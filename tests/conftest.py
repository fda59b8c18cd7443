"""The order files run in. `make test` runs two xdist workers, a file at a time each
(--dist loadfile), handing out files in collection order (--no-loadscope-reorder: by
default xdist sorts files by their number of tests, which put a 36 s file of 3 tests
last and left one worker idle for its last 40 s): the longest files go first, so that
the last file a worker takes is a short one and both finish together. The order is a
fresh machine's (2026-12-07, by the seconds of each file's tests among that run's 90
slowest): its inductor cache is empty, as in CI, and the files that compile the codecs
(test_kernels.py, test_gpu_check.py) took 111 and 68 s there, against 50 and 20 to 46 s
with a warm cache; unlisted, they ran last."""

from pathlib import Path

LONGEST_FIRST = ["deepspeed/test_hf_deepspeed.py", "deepspeed/test_hf_trl.py",
                 "apps/test_replicas.py", "engine/test_compile.py", "fsdp2/test_fsdp2.py",
                 "comm/test_kernels.py", "apps/test_train_cli.py", "fsdp2/test_fsdp2_nd.py",
                 "deepspeed/test_deepspeed_api.py", "apps/test_cluster.py", "apps/test_launch.py",
                 "engine/test_gathered.py", "apps/test_gpu_check.py", "engine/test_zeropp.py",
                 "deepspeed/test_alias.py", "engine/test_checkpoint.py", "deepspeed/test_hf.py",
                 "engine/test_deferred_init.py", "engine/test_zero3_parity.py",
                 "engine/test_activation_checkpointing.py", "engine/test_overlap.py",
                 "engine/test_zeropp_plus.py"]
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).resolve().relative_to(_HERE)
                                         .as_posix(), len(rank)))

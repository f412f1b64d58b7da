"""`python train.py ...` under a fault a test wants to provoke:

    python tests/faulty_train.py [--slow-commit MARKER FROM_STEP] [--slow-restore MARKER]
                                 [--file-size-limit BYTES] [--no-root-override]
                                 -- <train.py arguments>

--slow-commit: orbax commits a step by renaming `<step>.orbax-checkpoint-tmp` to `<step>` once
  every file (commit_success.txt included) is written; here that rename, for steps >= FROM_STEP,
  first creates MARKER and then waits ten minutes, so a test can kill the process when a save
  is as complete as it gets without being committed.
--slow-restore: a restore that takes a while (a large model's): it creates MARKER, then
  restores after five seconds, so a test can signal the process while it restores.
--file-size-limit: a full disk as far as a writer can tell, without a mount: RLIMIT_FSIZE
  makes writes past BYTES fail with EFBIG (Python ignores SIGXFSZ).
--no-root-override: file permissions apply even to root: CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
  and CAP_FOWNER leave the bounding set and this script execs itself again without them.
"""
import argparse
import asyncio
import ctypes
import os
import pathlib
import resource
import runpy
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PR_CAPBSET_DROP = 24
ROOT_OVERRIDES = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def slow_commits(marker: str, from_step: int) -> None:
    from orbax.checkpoint._src.path import async_path
    rename = async_path.rename

    async def slow_rename(src, dst):
        name = pathlib.Path(str(dst)).name
        if name.isdigit() and int(name) >= from_step:
            pathlib.Path(marker).write_text(str(src))
            await asyncio.sleep(600)
        return await rename(src, dst)
    async_path.rename = slow_rename


def slow_restores(marker: str) -> None:
    import time

    from jaxtrain.checkpoint import Checkpointer
    restore = Checkpointer.restore

    def slow_restore(self, *args, **kwargs):
        pathlib.Path(marker).write_text("restoring")
        time.sleep(5)
        return restore(self, *args, **kwargs)
    Checkpointer.restore = slow_restore


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow-commit", nargs=2, metavar=("MARKER", "FROM_STEP"))
    parser.add_argument("--slow-restore", metavar="MARKER")
    parser.add_argument("--file-size-limit", type=int)
    parser.add_argument("--no-root-override", action="store_true")
    args = parser.parse_args(argv[:split])
    if args.no_root_override and os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in ROOT_OVERRIDES:
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0):
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
        rest = [a for a in argv if a != "--no-root-override"]
        os.execv(sys.executable, [sys.executable, __file__, *rest])  # caps take effect on exec
    if args.file_size_limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_size_limit, args.file_size_limit))
    if args.slow_commit:
        slow_commits(args.slow_commit[0], int(args.slow_commit[1]))
    if args.slow_restore:
        slow_restores(args.slow_restore)
    sys.path.insert(0, str(ROOT))
    sys.argv = [str(ROOT / "train.py"), *argv[split + 1:]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()

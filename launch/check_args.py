"""Check training arguments with each training script's own parser and flags.check_flags, as
its jobs will, before anything starts: launch/job.sh runs it for one job,
launch/run_benchmarks.py once for a study. A typo or an impossible value (--epochs 0, an
unknown --model) then costs one sentence, not a failed job or a study of failed jobs.

    python launch/check_args.py ddp_train.py --epochs 3 --bogus
    python launch/check_args.py ddp_train,fsdp_train --epochs 3 --lr-scaling linear

Exit status: 0 every script accepts the arguments; 2 one refuses them, and its sentence
("ddp_train.py: error: ...") is the last line on stderr; anything else means not checked (a
script this Python cannot import: the error is the last line), 3 this Python has no torch ("error:
PYTHON cannot import torch" the last line). The callers go on in those cases, but job.sh stops at
3 where the training runs with this Python; the training itself will say why.
"""

import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINING_SCRIPTS = ("dp_train.py", "ddp_train.py", "fsdp_train.py")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print("usage: python launch/check_args.py SCRIPT[.py][,SCRIPT...] [TRAINING ARGS]",
              file=sys.stderr)
        return 1
    for script in argv[0].split(","):
        name = script if script.endswith(".py") else script + ".py"
        path = Path(name).resolve()
        if not path.is_file():  # a name of this repository's, from another folder
            path = REPO / name
        if not path.is_file():
            print(f"error: no training script {Path(name).resolve()}: name one of "
                  f"{', '.join(TRAINING_SCRIPTS)}, or its path", file=sys.stderr)
            return 1
        sys.path.insert(0, str(path.parent))  # the script's own imports (training/, ...)
        try:
            module = importlib.import_module(path.stem)
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            print(f"error: {sys.executable} cannot import torch", file=sys.stderr)
            return 3
        if not (callable(getattr(module, "build_parser", None))
                and callable(getattr(module, "train", None))):
            print(f"error: {path} is not a training script (one with build_parser() and "
                  f"train(), such as {', '.join(TRAINING_SCRIPTS)})", file=sys.stderr)
            return 1
        parser = module.build_parser()
        parser.prog = path.name  # argparse's sentence names the script, not this file
        args = parser.parse_args(argv[1:])
        flags = importlib.import_module("training.flags")
        try:
            flags.check_flags(args, data_known=bool(args.dataset or args.data_dir))
        except flags.UsageError as e:
            print(f"{path.name}: error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

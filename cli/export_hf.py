"""A saved checkpoint as a Hugging Face checkpoint: `python cli/export_hf.py <checkpoint dir> <out>`.

<checkpoint dir>: `<output_dir>/checkpoints/step_N` (or an output_dir: its latest checkpoint). Runs offline,
without Ray and without the devices of the layout that wrote it; the result is what `trainer.save_hf` writes
at that step (docs/outputs.md). A bad checkpoint exits 2 with one line naming the file and the fix.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="<output_dir>/checkpoints/step_N, or an output_dir (its latest checkpoint)")
    p.add_argument("out", help="the directory to write the Hugging Face checkpoint to (replaced if it exists)")
    p.add_argument("--model", default="actor", choices=["actor", "critic"],
                   help="actor (default): the policy, a causal LM; critic: a value model (one-label token classifier)")
    p.add_argument("--adapter-only", action="store_true",
                   help="a LoRA policy as a peft adapter (adapter_config.json, adapter_model.safetensors) instead "
                        "of its merged weights")
    p.add_argument("--base-model", default=None,
                   help="the checkpoint the run started from, when the path in its config is no longer there")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from mindspeed_rl.models.hf_export import ExportError
    from mindspeed_rl.trainer.export import export_checkpoint
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    try:
        out = export_checkpoint(args.checkpoint, args.out, model=args.model, base=args.base_model,
                                adapter_only=args.adapter_only)
    except ExportError as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

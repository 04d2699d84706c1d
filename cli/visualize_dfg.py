"""Draw an algorithm's dataflow graph (MFCs and the dock columns between them).

    python cli/visualize_dfg.py grpo                                  # -> grpo_dfg.svg
    python cli/visualize_dfg.py grpo --out docs/images/grpo_dfg.svg
    python cli/visualize_dfg.py grpo --format png                     # needs matplotlib
    python cli/visualize_dfg.py grpo --describe                       # also print the graph as text

The argument is an algorithm name (its full graph), or a config (a name under configs/, or a YAML
path) whose `rl_config.algorithm` names the algorithm: then the graph is the one that config runs
(no `ref_log_prob` stage without a KL term, as the trainer builds it).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("mindspeed_rl") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, REPO_ROOT)

from mindspeed_rl.config.schema import ActorConfig  # noqa: E402
from mindspeed_rl.dataflow import algorithm_graph, describe, known_algorithms  # noqa: E402
from mindspeed_rl.dataflow.options import FULL, AlgorithmOptions, uses_kl_loss  # noqa: E402
from mindspeed_rl.dataflow.draw import draw  # noqa: E402


def resolve_algorithm(arg: str, configs_dir: str | None = None) -> str:
    """Algorithm name for `arg`: a known algorithm, else the `rl_config.algorithm` of a config
    (`configs/<arg>.yaml`, `configs/<arg>`, or a YAML path). ValueError if neither."""
    return resolve(arg, configs_dir)[0]


def resolve(arg: str, configs_dir: str | None = None) -> tuple[str, AlgorithmOptions]:
    """(algorithm name, the graph options) for `arg`: a known algorithm gets its full graph, a config
    the graph it runs (its KL settings decide the reference stage, with the schema's defaults)."""
    known = known_algorithms()
    if arg.strip().lower() in known:
        return arg.strip().lower(), FULL
    configs_dir = configs_dir or os.path.join(REPO_ROOT, "configs")
    candidates = [os.path.join(configs_dir, arg + ".yaml"), os.path.join(configs_dir, arg), arg]
    path = next((c for c in candidates if c.endswith((".yaml", ".yml")) and os.path.isfile(c)), None)
    if path is None:
        raise ValueError(f"{arg!r} is neither a known algorithm ({', '.join(known)}) nor a config "
                         f"(looked for {candidates[0]} and {arg})")
    import yaml
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    algo = (cfg.get("rl_config") or {}).get("algorithm") if isinstance(cfg, dict) else None
    if not algo:
        raise ValueError(f"config {path} has no rl_config.algorithm; set it to one of {', '.join(known)}")
    if str(algo).strip().lower() not in known:
        raise ValueError(f"config {path}: rl_config.algorithm={algo!r} is not a known algorithm; "
                         f"known algorithms: {', '.join(known)}")
    actor = cfg.get("actor_config") or {}
    options = AlgorithmOptions(use_reference=uses_kl_loss(actor.get("use_kl_loss", ActorConfig.use_kl_loss),
                                                          actor.get("kl_loss_coef", ActorConfig.kl_loss_coef)))
    return str(algo).strip().lower(), options


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algorithm", help=f"algorithm ({', '.join(known_algorithms())}) or config name/path")
    parser.add_argument("--out", help="output file (default: <algorithm>_dfg.<format> here)")
    parser.add_argument("--format", choices=("svg", "png"),
                        help="picture format (default: from --out's suffix, else svg)")
    parser.add_argument("--describe", action="store_true", help="also print the graph as text")
    args = parser.parse_args(argv)
    try:
        name, options = resolve(args.algorithm)
    except ValueError as e:
        parser.error(str(e))
    fmt = args.format
    if args.out and fmt is None:
        fmt = "png" if args.out.lower().endswith(".png") else "svg"
    fmt = fmt or "svg"
    if args.out and os.path.splitext(args.out)[1].lower() in (".svg", ".png") \
            and os.path.splitext(args.out)[1].lower() != "." + fmt:
        parser.error(f"--format {fmt} does not match --out {args.out}")
    out = args.out or f"{name}_dfg.{fmt}"
    g = algorithm_graph(name, options)
    if args.describe:
        print(describe(g))
    try:
        draw(g, out, fmt)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The DFG pictures: SVG in-process, the CLI through subprocess (SVG, PNG, configs, errors)."""
import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from mindspeed_rl.dataflow import MFCDef, algorithm_graph, build_graph
from mindspeed_rl.dataflow.draw import draw, to_svg, write_png

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(REPO, "cli", "visualize_dfg.py")
SVG = "{http://www.w3.org/2000/svg}"
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _texts(root):
    return [t.text for t in root.iter(SVG + "text")]


def test_svg_shows_every_mfc_and_edge():
    g = algorithm_graph("grpo")
    root = ET.fromstring(to_svg(g))
    assert root.tag == SVG + "svg"
    texts = _texts(root)
    for name in g.nodes:
        assert name in texts
    assert "dataset" in texts and "actor · generate" in texts and "weights: actor" in texts
    assert "response_length, responses" in texts and "labels, prompts" in texts
    paths = list(root.iter(SVG + "path"))
    assert sum(p.get("class") == "data-edge" for p in paths) == 8 + 5   # MFC edges + dataset edges
    assert sum(p.get("class") == "version-edge" for p in paths) == 1
    assert all(p.get("stroke-dasharray") for p in paths if p.get("class") == "version-edge")
    assert sum(r.get("class") == "mfc" for r in root.iter(SVG + "rect")) == 6


def test_svg_of_self_loop_and_deterministic():
    g = build_graph([MFCDef("sft", "policy", "train_step", ["prompts"], [])])
    svg = to_svg(g)
    assert svg == to_svg(g)
    assert "weights: policy" in _texts(ET.fromstring(svg))


def test_png_without_matplotlib_says_pip_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        write_png(algorithm_graph("grpo"), str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="'pdf'"):
        draw(algorithm_graph("grpo"), str(tmp_path / "x.pdf"), "pdf")


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_cli_svg(tmp_path):
    out = tmp_path / "sub" / "grpo.svg"
    r = _cli("grpo", "--out", str(out), "--describe")
    assert r.returncode == 0, r.stderr
    assert "weight sync after actor_train: actor_rollout, actor_log_prob" in r.stdout
    assert ET.parse(out).getroot().tag == SVG + "svg"


def test_cli_default_out_and_config(tmp_path):
    cfg = tmp_path / "my_run.yaml"
    cfg.write_text("rl_config:\n  algorithm: grpo\n")
    r = _cli(str(cfg), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert ET.parse(tmp_path / "grpo_dfg.svg").getroot().tag == SVG + "svg"


@pytest.mark.slow
def test_cli_errors(tmp_path):
    r = _cli("no_such_algo")
    assert r.returncode == 2 and "'no_such_algo'" in r.stderr and "grpo" in r.stderr
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("rl_config:\n  n_samples_per_prompt: 4\n")
    r = _cli(str(cfg))
    assert r.returncode == 2 and "rl_config.algorithm" in r.stderr
    r = _cli("grpo", "--format", "png", "--out", str(tmp_path / "x.svg"))
    assert r.returncode == 2 and "does not match" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed")
def test_cli_png(tmp_path):
    out = tmp_path / "grpo.png"
    r = _cli("grpo", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_a_config_draws_the_graph_it_runs(tmp_path):
    """grpo_tiny has no KL term (kl_loss_coef 0): its picture has no reference stage, as its run has
    none; the algorithm's name alone draws the full graph; a config with a KL term draws the stage."""
    def mfcs(arg):
        out = tmp_path / "g.svg"
        proc = subprocess.run([sys.executable, CLI, arg, "--out", str(out)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        root = ET.fromstring(out.read_text())
        return {t for t in _texts(root) if t in algorithm_graph("grpo").nodes}

    assert "ref_log_prob" not in mfcs("grpo_tiny")
    assert "ref_log_prob" in mfcs("grpo")
    with_kl = tmp_path / "kl.yaml"
    with_kl.write_text("rl_config: {algorithm: grpo}\nactor_config: {use_kl_loss: true, kl_loss_coef: 0.001}\n")
    assert "ref_log_prob" in mfcs(str(with_kl))

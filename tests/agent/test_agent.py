"""The agent rollout: tools, call syntax, a tool call bounded by its timeout, and the multi-turn loop
(on a scripted engine, then on the built-in tool model with the HF engine)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from mindspeed_rl.agent import (AgentLoop, MalformedCall, ToolCall, ToolRunner, calc, final_answer, get_syntax,
                                get_tool, get_tools, tool_name, turn_seed)
from mindspeed_rl.engines import Rollout, SamplingParams

EX = "tests.agent.tools_example"
TAGS, JSON = get_syntax("tags"), get_syntax("json")


# ------------------------------------------------------------------------------ tools
@pytest.mark.parametrize("expr, out", [("1234+5678", "6912"), ("9999+9999", "19998"), ("7/2", "3.5"),
                                       ("2*(3-5)", "-4"), (" 10 // 3 ", "3"), ("10 % 4", "2"), ("1/3", "0.3333333333"),
                                       ("0.1+0.2", "0.3"), ("0314+0007", "321"), ("0.05*2", "0.1"), ("100+0", "100"), ('{"expression": "6*7"}', "42")])
def test_calc(expr, out):
    assert calc(expr) == out


@pytest.mark.parametrize("expr, words", [("", "empty"), ("1+", "cannot parse"), ("__import__('os')", "only numbers"),
                                         ("1/0", "division by zero"), ("9**9**9", "only numbers"),
                                         ("1" * 300, "longer than"), ('{"x": 1}', "expression")])
def test_calc_refuses_what_is_not_arithmetic(expr, words):
    with pytest.raises(ValueError, match=words):
        calc(expr)


def test_tools_by_name_and_dotted_path():
    assert get_tool("calc") is calc
    tools = get_tools(["calc", f"{EX}:echo", f"{EX}.broken"])
    assert list(tools) == ["calc", "echo", "broken"] and tools["echo"]("x") == "x"
    assert tool_name(f"{EX}:echo") == "echo"
    for bad, words in (("nosuch", "unknown tool 'nosuch'"), (f"{EX}:missing", "has no attribute"),
                       ("no_such_mod.x:f", "cannot import module"), (f"{EX}:NOT_A_FUNCTION", "not a function"),
                       ("", "unknown tool")):
        with pytest.raises(ValueError, match=words):
            get_tool(bad)
    with pytest.raises(ValueError, match="two tools are called 'echo'"):
        get_tools([f"{EX}:echo", f"{EX}.echo"])


# ------------------------------------------------------------------------------ syntax
def test_tags_syntax():
    assert TAGS.call_ends(["calc", "echo"]) == ["</calc>", "</echo>"]
    assert TAGS.parse("I will add: <calc>12+30</calc>", ["calc"]) == ToolCall("calc", "12+30")
    assert TAGS.parse("<calc>1</calc> and <calc>2+2</calc>", ["calc"]) == ToolCall("calc", "2+2"), "the last call"
    assert TAGS.result("6912") == "<result>6912</result>" and TAGS.error("x") == "<result>error: x</result>"
    with pytest.raises(MalformedCall, match="</calc> without <calc>"):
        TAGS.parse("12+30</calc>", ["calc"])
    with pytest.raises(MalformedCall, match="no known tool"):
        TAGS.parse("<echo>1</echo>", ["calc"])


def test_json_syntax():
    assert JSON.call_ends(["calc"]) == ["</tool_call>"]
    text = 'ok <tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>'
    assert JSON.parse(text, ["calc"]) == ToolCall("calc", '{"expression": "1+2"}')
    assert JSON.parse('<tool_call>{"name": "calc", "arguments": "3*3"}</tool_call>', ["calc"]).arguments == "3*3"
    for bad, words in (('<tool_call>{"name": "calc"</tool_call>', "not JSON"),
                       ('<tool_call>["calc"]</tool_call>', '"name"'),
                       ('<tool_call>{"name": "rm", "arguments": ""}</tool_call>', "unknown tool 'rm'"),
                       ('{"name": "calc"}</tool_call>', "without <tool_call>")):
        with pytest.raises(MalformedCall, match=words):
            JSON.parse(bad, ["calc"])
    assert JSON.result("3") == "<tool_response>3</tool_response>"


def test_final_answer_is_the_text_after_the_last_result():
    assert final_answer("<calc>1+1</calc><result>2</result>2") == "2"
    assert final_answer("<calc>1</calc><result>1</result>x<calc>2</calc><result>2</result> 7") == " 7"
    assert final_answer('<tool_call>{}</tool_call><tool_response>5</tool_response>5') == "5"
    assert final_answer("no tool 12") == "no tool 12"
    # result markers the model writes itself (not after a call's closing marker) are not a tool's result
    assert final_answer("<calc>1+1</result>7</result>11") == "<calc>1+1</result>7</result>11"
    assert final_answer("<calc>1+1</calc><result>2</result>2</result>9") == "2</result>9"


# ------------------------------------------------------------------------------ one call
def _runner(timeout_s=5.0):
    return ToolRunner(get_tools(["calc", f"{EX}:slow", f"{EX}:broken", f"{EX}:not_text"]), TAGS, timeout_s)


def _answer(runner, text):
    call = runner.start(text)
    while not call.finished(time.monotonic()):
        ToolRunner.wait_any([call], block=True)
    return call.outcome(runner.syntax, runner.timeout_s)


def test_a_call_answers_with_its_result_or_an_error_result():
    r = _runner()
    assert _answer(r, "<calc>1234+5678</calc>") == ("ok", "<result>6912</result>")
    assert _answer(r, "<calc>1+</calc>") == ("raised", "<result>error: calc raised ValueError: calc: cannot parse "
                                                       "'1+'</result>")
    assert _answer(r, "<broken>x</broken>") == ("raised", "<result>error: broken raised RuntimeError: cannot handle "
                                                          "'x'</result>")
    assert _answer(r, "<not_text>x</not_text>") == ("raised", "<result>error: not_text returned int, not text</result>")
    assert _answer(r, "1+1</calc>") == ("malformed", "<result>error: </calc> without <calc> before it: write "
                                                     "<calc>arguments</calc></result>")


def test_a_hung_tool_times_out_into_an_error_result():
    r = _runner(timeout_s=0.2)
    t0 = time.monotonic()
    status, text = _answer(r, "<slow>30</slow>")
    assert (status, text) == ("timeout", "<result>error: slow timed out after 0.2 s</result>")
    assert time.monotonic() - t0 < 2.0, "the rollout waited for the hung tool"


def test_bad_runner_arguments():
    with pytest.raises(ValueError, match="timeout_s=0"):
        ToolRunner({"calc": calc}, TAGS, 0)


# ------------------------------------------------------------------------------ the loop on a scripted engine
class CharTok:
    """A character tokenizer with the tool markers as tokens: enough for the loop's encode/decode."""

    MARKERS = ["<calc>", "</calc>", "<result>", "</result>", "<slow>", "</slow>", "<eos>"]

    def __init__(self):
        self.vocab = self.MARKERS + [chr(c) for c in range(32, 127)]
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.eos = self.ids["<eos>"]

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            m = next((m for m in self.MARKERS if text.startswith(m, i)), None)
            out.append(self.ids[m or text[i]])
            i += len(m) if m else 1
        return out

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[i] for i in ids)


class ScriptedEngine:
    """`generate` answers each row from a script: the text to write at the row's turn (the turn is
    read from how many results its context holds), stopped at the first stop token. Records batches."""

    def __init__(self, tok, script):
        self.tok, self.script, self.batches = tok, script, []

    def generate(self, prompts, params, seeds):
        self.batches.append((time.monotonic(), [int(p[0]) for p in prompts]))
        out, lps = [], []
        for p, seed in zip(prompts, seeds):
            row = int(p[0])
            turn = self.tok.decode(p.tolist()).count("</result>")
            ids = self.tok.encode(self.script[row][turn])[:params.max_new_tokens]
            cut = next((i + 1 for i, t in enumerate(ids) if t in params.stop_token_ids), len(ids))
            out.append(torch.tensor(ids[:cut]))
            lps.append(torch.full((cut,), -0.5 - (seed % 7) / 10))
        return Rollout(out, lps)


def _loop(script, tools=("calc",), max_turns=4, timeout_s=5.0, tool_choice=None, return_direct=()):
    tok = CharTok()
    engine = ScriptedEngine(tok, script)
    loop = AgentLoop(engine, tok, get_tools([t if t == "calc" else f"{EX}:{t}" for t in tools]), TAGS, max_turns,
                     timeout_s, tool_choice=tool_choice, return_direct=return_direct)
    return loop, engine, tok


def _params(n=64, tok=None):
    return SamplingParams(max_new_tokens=n, stop_token_ids=(CharTok().eos,))


def test_a_call_its_result_and_the_answer_make_one_trajectory():
    script = {0: ["<calc>12+30</calc>", "42<eos>"], 1: ["7<eos>"]}
    loop, engine, tok = _loop(script)
    prompts = [torch.tensor([0]), torch.tensor([1])]
    out = loop.run(prompts, _params(), [10, 11])
    text = [tok.decode(r.tolist()) for r in out.responses]
    assert text == ["<calc>12+30</calc><result>42</result>42<eos>", "7<eos>"]
    call, result, answer = (len(tok.encode(s)) for s in ("<calc>12+30</calc>", "<result>42</result>", "42<eos>"))
    assert out.loss_masks[0].tolist() == [1] * call + [0] * result + [1] * answer
    assert out.loss_masks[1].tolist() == [1, 1]
    lp = out.log_probs[0]
    assert lp[call:call + result].abs().max() == 0 and (lp[:call] != 0).all() and (lp[call + result:] != 0).all()
    assert out.turns == [2, 1] and out.truncated == [False, False] and out.calls["ok"] == 1
    # turn 0 samples with the row's seed, turn 1 with a seed derived from it
    assert lp[0] == -0.5 - (10 % 7) / 10 and lp[-1] == -0.5 - (turn_seed(10, 1) % 7) / 10


def test_tool_choice_gives_the_opening_marker_and_the_model_writes_the_rest():
    script = {0: ["12+30</calc>", "42<eos>"]}
    loop, _, tok = _loop(script, tool_choice="calc")
    out = loop.run([torch.tensor([0])], _params(), [10])
    assert tok.decode(out.responses[0].tolist()) == "<calc>12+30</calc><result>42</result>42<eos>"
    assert out.loss_masks[0].tolist() == [0] + [1] * 6 + [0] * 4 + [1] * 3, "the given marker is not trained"
    assert out.log_probs[0][0] == 0 and out.calls["ok"] == 1
    with pytest.raises(ValueError, match="tool_choice='slow' is not one of the tools"):
        _loop(script, tool_choice="slow")


def test_a_return_direct_tool_answers_for_the_model_and_ends_the_row():
    # row 0: the call is answered and its result written as the answer (not trained), then <eos>: no second turn;
    # row 1: a failed call of the same tool is an error result like any other, and the model writes its answer
    script = {0: ["12+30</calc>", "never asked"], 1: ["1/0</calc>", "5<eos>"]}
    loop, engine, tok = _loop(script, tool_choice="calc", return_direct=["calc"])
    out = loop.run([torch.tensor([0]), torch.tensor([1])], _params(), [3, 4])
    text = [tok.decode(r.tolist()) for r in out.responses]
    assert text[0] == "<calc>12+30</calc><result>42</result>42<eos>"
    assert final_answer(text[0].removesuffix("<eos>")) == "42"
    assert out.loss_masks[0].tolist() == [0] + [1] * 6 + [0] * (4 + 3), "the result and the answer are not trained"
    assert out.log_probs[0][7:].abs().max() == 0
    assert text[1] == "<calc>1/0</calc><result>error: calc raised ValueError: calc: division by zero</result>5<eos>"
    assert out.turns == [1, 2] and out.truncated == [False, False]
    assert out.calls == {"ok": 1, "malformed": 0, "raised": 1, "timeout": 0}
    # the answer cut by max_new_tokens: the row ends, truncated
    out = loop.run([torch.tensor([0])], _params(n=10), [3])
    assert tok.decode(out.responses[0].tolist()) == "<calc>12+30</calc><result>42" and out.truncated == [True]
    with pytest.raises(ValueError, match=r"return_direct=\['nope'\]: \['nope'\] are not among the tools"):
        _loop(script, return_direct=["nope"])


def test_malformed_and_failing_calls_become_error_results_and_the_row_goes_on():
    script = {0: ["12+30</calc>", "0<eos>"], 1: ["<calc>1/0</calc>", "1<eos>"]}
    loop, _, tok = _loop(script)
    out = loop.run([torch.tensor([0]), torch.tensor([1])], _params(), [1, 2])
    text = [tok.decode(r.tolist()) for r in out.responses]
    assert text[0] == "12+30</calc><result>error: </calc> without <calc> before it: write <calc>arguments</calc>" \
                      "</result>0<eos>"
    assert text[1] == "<calc>1/0</calc><result>error: calc raised ValueError: calc: division by zero</result>1<eos>"
    assert out.calls == {"ok": 0, "malformed": 1, "raised": 1, "timeout": 0}


def test_max_turns_and_the_token_budget_bound_a_trajectory():
    calls = ["<calc>1+1</calc>"] * 5
    loop, _, tok = _loop({0: calls, 1: calls}, max_turns=3)
    out = loop.run([torch.tensor([0])], _params(), [0])
    # 3 turns, each a call; the last turn's call is not run (no turn left to read its result)
    assert tok.decode(out.responses[0].tolist()) == "<calc>1+1</calc><result>2</result>" * 2 + "<calc>1+1</calc>"
    assert out.turns == [3] and out.truncated == [True] and out.calls["ok"] == 2
    out = loop.run([torch.tensor([1])], _params(n=20), [0])  # 5 call tokens + a result of 3: cut at 20
    assert len(out.responses[0]) == 20 and out.truncated == [True]
    assert out.loss_masks[0].tolist() == [1] * 5 + [0] * 3 + [1] * 5 + [0] * 3 + [1] * 4


def test_a_row_waiting_on_a_slow_tool_does_not_stall_the_others():
    script = {0: ["<slow>1.0</slow>", "9<eos>"],
              1: ["<calc>1+1</calc>", "<calc>2+2</calc>", "<calc>3+3</calc>", "6<eos>"]}
    loop, engine, tok = _loop(script, tools=("calc", "slow"))
    t0 = time.monotonic()
    out = loop.run([torch.tensor([0]), torch.tensor([1])], _params(), [0, 1])
    assert [tok.decode(r.tolist())[-5:] for r in out.responses] == ["9<eos>"[-5:], "6<eos>"[-5:]]
    # row 1 ran its 4 turns while row 0's tool slept: all of them started before the tool answered
    row1 = [t - t0 for t, rows in engine.batches if 1 in rows]
    assert len(row1) == 4 and max(row1) < 0.8, row1
    assert any(rows == [0] for _, rows in engine.batches[1:]), "row 0 came back alone, after its tool"


def test_a_hung_tool_times_out_and_the_row_goes_on():
    loop, _, tok = _loop({0: ["<slow>60</slow>", "0<eos>"]}, tools=("slow",), timeout_s=0.3)
    t0 = time.monotonic()
    out = loop.run([torch.tensor([0])], _params(), [0])
    assert time.monotonic() - t0 < 3.0
    assert tok.decode(out.responses[0].tolist()) == "<slow>60</slow><result>error: slow timed out after 0.3 s" \
                                                    "</result>0<eos>"
    assert out.calls["timeout"] == 1


def test_a_call_marker_that_is_not_one_token_is_refused():
    class Words(CharTok):
        MARKERS = ["<eos>"]
    with pytest.raises(ValueError, match=r"the call marker '</calc>' is 7 tokens.*must be one token"):
        AgentLoop(ScriptedEngine(Words(), {}), Words(), {"calc": calc}, TAGS, 2, 1.0)


# ------------------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def tool_model():
    from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
    from mindspeed_rl.models import load_causal_lm, load_tokenizer
    tok = load_tokenizer("builtin:tiny-qwen2-tool")
    return HFRolloutEngine(load_causal_lm("builtin:tiny-qwen2-tool"), tok.pad_token_id), tok


def _tool_prompts(tok, n):
    from mindspeed_rl.data import SyntheticTask
    import numpy as np
    pairs = SyntheticTask("sum", 4).sample_many(np.random.default_rng(0), n)
    return [torch.tensor(tok.encode(p, add_special_tokens=False)) for p, _ in pairs]


def test_hf_agent_rollouts_are_deterministic_whatever_the_batches(tool_model):
    """Same seeds, same trajectories: in one batch, split in two, and with the rows reversed (what
    guarantee_order relies on: a row's trajectory depends on its seed and its tools, not its company)."""
    engine, tok = tool_model
    loop = AgentLoop(engine, tok, get_tools(["calc"]), TAGS, max_turns=3, tool_timeout_s=5.0)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=(tok.eos_token_id,))
    prompts = _tool_prompts(tok, 16)
    seeds = [1000 + i for i in range(16)]
    whole = loop.run(prompts, params, seeds)
    halves = [loop.run(prompts[:7], params, seeds[:7]), loop.run(prompts[7:], params, seeds[7:])]
    back = loop.run(prompts[::-1], params, seeds[::-1])
    for i in range(16):
        h = halves[0] if i < 7 else halves[1]
        j = i if i < 7 else i - 7
        for other, k in ((h, j), (back, 15 - i)):
            assert other.responses[k].tolist() == whole.responses[i].tolist(), i
            assert other.loss_masks[k].tolist() == whole.loss_masks[i].tolist()
            torch.testing.assert_close(other.log_probs[k], whole.log_probs[i], rtol=0, atol=1e-5)  # batch rounding
    assert sum(whole.calls.values()) > 0, "the random model made no call: the loop's tool path was not exercised"
    assert all(len(r) <= 24 for r in whole.responses)
    for r, m, lp in zip(whole.responses, whole.loss_masks, whole.log_probs):
        assert len(r) == len(m) == len(lp) and (lp[m == 0] == 0).all()


def test_without_calls_an_agent_rollout_is_the_plain_rollout(tool_model):
    engine, tok = tool_model
    calc_end = tok.convert_tokens_to_ids("</calc>")
    loop = AgentLoop(engine, tok, get_tools(["calc"]), TAGS, max_turns=3, tool_timeout_s=5.0)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(tok.eos_token_id,))
    prompts = _tool_prompts(tok, 32)
    seeds = list(range(32))
    agent = loop.run(prompts, params, seeds)
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=12, stop_token_ids=(tok.eos_token_id, calc_end)),
                            seeds)
    same = [i for i in range(32) if calc_end not in plain.responses[i].tolist()]
    assert len(same) > 5
    for i in same:
        assert agent.responses[i].tolist() == plain.responses[i].tolist()
        torch.testing.assert_close(agent.log_probs[i], plain.log_probs[i], rtol=0, atol=1e-5)
        assert agent.turns[i] == 1

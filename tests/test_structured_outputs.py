"""Structured outputs offline: every decoder's output matches its constraint (JSON schema,
JSON object, regex, choice, EBNF grammar) on every request, on full-attention and
block-causal models; the constraint's incremental grammar state (accept, rollback on a
revision, completion near the end of the slots) equals a fresh matcher re-fed the canvas after
every step; and the per-decision rules on hand-made decisions."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from cover_vllm import LLM, SamplingParams, StructuredOutputsParams
from cover_vllm.engine.observer import StepObserver
from cover_vllm.step_plan import RowDecision
from cover_vllm.structured_output.constraint import ViewRow, constrain_decision
from conftest import DREAM_DIR
from golden_cases import GOLDEN

PROMPTS = ["347+158=", "What is 12+7?", "Q: 5+8=", "hello", "212+399=", "Name a color.",
           "x", "Sort: c a b"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
REGEX = r"[0-9]{1,3}(\.[0-9]+)?"
CHOICES = ["yes", "no", "maybe"]
DECODERS = ["cover", "threshold", "low_confidence"]
TINY_TOKENIZER = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _answer_is_int(text: str) -> bool:
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) <= {"answer"}
            and type(value.get("answer")) is int)


def _valid(kind: str, text: str) -> bool:
    try:
        if kind == "json":
            return _answer_is_int(text)
        if kind == "json_object":
            return isinstance(json.loads(text), dict)
        if kind == "regex":
            return re.fullmatch(REGEX, text) is not None
        if kind == "choice":
            return text in CHOICES
        return re.fullmatch(r"\(*x\)*", text) is not None and text.count("(") == text.count(")")
    except json.JSONDecodeError:
        return False


CONSTRAINTS = {"json": dict(json=SCHEMA), "regex": dict(regex=REGEX),
               "choice": dict(choice=CHOICES), "json_object": dict(json_object=True),
               "grammar": dict(grammar='root ::= "(" root ")" | "x"')}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("cover-tiny")


class _Invariant(StepObserver):
    """After every step, a fresh matcher re-fed each constrained request's canvas must accept
    its generated tokens up to the grammar's frontier, and only [MASK] may follow: the slow
    reference of the incremental state (accept / rollback / completion)."""

    def __init__(self, engine):
        self.engine, self.checked, self.rollbacks = engine, 0, 0

    def on_step(self, record) -> None:
        for req in self.engine._requests.values():
            if req.grammar is None:
                continue
            import xgrammar as xgr

            fresh = xgr.GrammarMatcher(req.grammar.compiled)
            gen = req.canvas[req.prompt_len: req.gen_end].tolist()
            accepted = req.grammar.frontier - req.prompt_len
            assert all(fresh.accept_token(t) for t in gen[:accepted])
            assert all(t == req.mask_id for t in gen[accepted:])
            self.checked += 1
            self.rollbacks = max(self.rollbacks, req.grammar.rollbacks)


@pytest.mark.parametrize("decoding", DECODERS)
@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_every_output_matches_its_constraint(llm, decoding, kind) -> None:
    params = SamplingParams(max_tokens=32, decoding=decoding,
                            structured_outputs=StructuredOutputsParams(**CONSTRAINTS[kind]))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(_valid(kind, t) for t in texts), texts
    assert all(o.metrics.constraint_s > 0 for o in outs)


@pytest.mark.parametrize("kind", ["json_object", "grammar"])
def test_json_object_and_ebnf_grammar(llm, kind) -> None:
    params = SamplingParams(max_tokens=24, decoding="cover", structured_outputs=CONSTRAINTS[kind])
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert all(_valid(kind, t) for t in texts), texts


@pytest.mark.parametrize("decoding", DECODERS + ["wino", "saber", "asrd", "random"])
def test_incremental_grammar_state_equals_a_fresh_matcher(llm, decoding) -> None:
    engine = llm.engine
    watch = _Invariant(engine)
    engine.add_observer(watch)
    try:
        params = SamplingParams(max_tokens=32, decoding=decoding, temperature=0.7, seed=3,
                                structured_outputs=StructuredOutputsParams(
                                    json=SCHEMA, disable_any_whitespace=True))
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.remove_observer(watch)
    assert watch.checked > len(PROMPTS)
    assert all(_answer_is_int(o.outputs[0].text) for o in outs), [o.outputs[0].text
                                                                   for o in outs]
    if decoding == "cover":      # its checks revise prefix tokens: the grammar rolled back
        assert watch.rollbacks > 0


# ---- the per-decision rules, on hand-made decisions ------------------------------------
MASK, EOS = 2, 1


@pytest.fixture(scope="module")
def backend(llm):
    return llm.engine._grammars()


def _ids(llm, text: str) -> list[int]:
    """One single-character token per character (cover-tiny also merges some pairs)."""
    return [llm.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in text]


def _view(tokens: list[int], prefer: dict[int, list[int]] | None = None) -> ViewRow:
    """A view of len(tokens) positions from canvas position 0 (no prompt); row i's logits
    rank `prefer[i]` first (in order), everything else below."""
    logits = torch.zeros(len(tokens), 227)
    for i, ranked in (prefer or {}).items():
        for rank, token in enumerate(ranked):
            logits[i, token] = 10.0 - rank
    return ViewRow(0, torch.tensor(tokens), logits, torch.ones(len(tokens), dtype=torch.bool),
                   len(tokens), MASK, 0.0, torch.Generator().manual_seed(0))


def _decision(n: int, commit: dict[int, int] = {}, replace: dict[int, int] = {},
              remask: tuple = ()) -> RowDecision:
    tokens = torch.full((n,), MASK)
    c, r, m = (torch.zeros(n, dtype=torch.bool) for _ in range(3))
    for pos, tok in commit.items():
        c[pos], tokens[pos] = True, tok
    for pos, tok in replace.items():
        r[pos], tokens[pos] = True, tok
    for pos in remask:
        m[pos] = True
    return RowDecision(commit=c, tokens=tokens, remask=m, replace=r, keeps=0, verified=0)


def _state(backend, kind: dict, accepted: list[int] = ()):
    state = backend.new_state(StructuredOutputsParams(**kind), 0)
    for token in accepted:
        assert state.matcher.accept_token(token)
    state.frontier = len(accepted)
    return state


def test_only_the_valid_run_from_the_frontier_is_kept(llm, backend) -> None:
    yes = _ids(llm, "yes")
    state = _state(backend, dict(choice=["yes", "no"]))
    d = constrain_decision(state, _view([MASK] * 8),
                           _decision(8, commit={0: yes[0], 1: yes[1], 2: yes[2], 5: 40}))
    assert d.tokens[:3].tolist() == yes and d.commit.tolist() == [True] * 3 + [False] * 5
    assert state.frontier == 3 and not d.stop


def test_the_frontier_is_drawn_when_nothing_else_advances(llm, backend) -> None:
    n, y = _ids(llm, "n")[0], _ids(llm, "y")[0]
    state = _state(backend, dict(choice=["yes", "no"]))
    d = constrain_decision(state, _view([MASK] * 8, {0: [40, n, y]}),   # 40: not allowed
                           _decision(8, commit={4: y}))
    assert d.commit.nonzero().flatten().tolist() == [0] and int(d.tokens[0]) == n


def test_a_complete_value_ends_the_request_with_eos(llm, backend) -> None:
    yes = _ids(llm, "yes")
    state = _state(backend, dict(choice=["yes", "no"]), yes)
    d = constrain_decision(state, _view(yes + [MASK] * 5), _decision(8, commit={3: EOS}))
    assert d.stop and d.tokens[3:].tolist() == [EOS] * 5


def test_a_revision_the_grammar_rejects_is_vetoed_and_rolls_back(llm, backend) -> None:
    yes = _ids(llm, "yes")
    state = _state(backend, dict(choice=["yes", "no"]), yes)
    d = constrain_decision(state, _view(yes + [MASK] * 5),
                           _decision(8, replace={1: _ids(llm, "x")[0]}))
    assert d.replace is None and d.remask is None and state.rollbacks == 1
    assert d.tokens[:3].tolist() == yes     # re-accepted up to where it was, then the
    assert d.stop and int(d.tokens[3]) == EOS   # frontier drawn: after "yes" only EOS fits


def test_a_remasked_prefix_token_is_redrawn_and_what_follows_rechecked(llm, backend) -> None:
    yes, no = _ids(llm, "yes"), _ids(llm, "no")
    state = _state(backend, dict(choice=["yes", "no"]), yes)
    view = _view(yes + [MASK] * 5, {0: [no[0]], 1: [yes[1], no[1]], 2: [EOS]})
    d = constrain_decision(state, view, _decision(8, remask=(0,)))
    assert d.tokens[:2].tolist() == no and d.stop and d.tokens[2:].tolist() == [EOS] * 6
    assert state.rollbacks == 1


def test_a_value_is_closed_before_the_slots_run_out(llm, backend) -> None:
    digits = _ids(llm, "1234")
    state = _state(backend, dict(regex="[0-9]+"))
    d = constrain_decision(state, _view([MASK] * 4), _decision(4, commit=dict(enumerate(digits))))
    assert d.tokens.tolist() == digits[:3] + [EOS] and d.stop


# ---- other families, n, logprobs, errors -----------------------------------------------
def _with_tiny_tokenizer(model_dir: str, tmp_path) -> str:
    """A golden checkpoint (random tiny weights) given cover-tiny's tokenizer: its vocabulary
    covers the first 227 ids, so grammars have text to work with."""
    from importlib.resources import files

    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    tiny = files("cover_vllm") / "assets" / "cover-tiny"
    for name in TINY_TOKENIZER:
        shutil.copy(tiny / name, out / name)
    return str(out)


@pytest.mark.parametrize("family", ["llada2", "sdar", "dream"])
def test_block_causal_and_shifted_families(family, tmp_path) -> None:
    source = DREAM_DIR if family == "dream" else str(GOLDEN / family / "model")
    llm = LLM(_with_tiny_tokenizer(source, tmp_path))
    decoders = {"llada2": ["llada2", "cover"], "sdar": ["sdar", "threshold"],
                "dream": ["entropy", "cover"]}[family]
    for decoding in decoders:
        for kind in ("json", "choice"):
            params = SamplingParams(max_tokens=40, block_length=8, decoding=decoding,
                                    structured_outputs=CONSTRAINTS[kind])
            texts = [o.outputs[0].text for o in llm.generate(PROMPTS[:4], params,
                                                               use_tqdm=False)]
            assert all(_valid(kind, t) for t in texts), (decoding, kind, texts)
    llm.shutdown()


def test_n_outputs_each_match_with_logprobs_of_the_written_tokens(llm) -> None:
    params = SamplingParams(n=3, max_tokens=32, temperature=1.0, seed=5, logprobs=2,
                            decoding="cover", structured_outputs=CONSTRAINTS["json"])
    (out,) = llm.generate(["347+158="], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert _valid("json", c.text), c.text
        assert len(c.logprobs) == len(c.token_ids)
        assert all(t in entry for t, entry in zip(c.token_ids, c.logprobs))


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of"),
    (dict(json=SCHEMA, regex="a"), "exactly one of"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(regex=3), "regex must be a non-empty string"),
    (dict(json=SCHEMA, whitespace_pattern=" "), "whitespace_pattern is not supported"),
])
def test_bad_structured_outputs_name_the_field(kwargs, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kind, value", [("regex", "[0-9"), ("json", {"type": "foo"}),
                                         ("grammar", "root ::= ")])
def test_an_uncompilable_constraint_is_refused_before_queueing(llm, kind, value) -> None:
    params = SamplingParams(max_tokens=8, structured_outputs={kind: value})
    with pytest.raises(ValueError, match=rf"structured_outputs\.{kind} could not be compiled"):
        llm.generate(["hello", "world"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (ok,) = llm.generate(["hello"], SamplingParams(max_tokens=8,
                                                   structured_outputs=CONSTRAINTS["choice"]),
                         use_tqdm=False)
    assert ok.outputs[0].text in CHOICES


def test_a_model_without_tokenizer_refuses_structured_outputs() -> None:
    llm = LLM(str(GOLDEN / "llada" / "model"))
    with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8,
                                                 structured_outputs=CONSTRAINTS["choice"]),
                     use_tqdm=False)


NESTED = {"type": "object", "required": ["name", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "tags": {"type": "array", "items": {"type": "integer"}},
                         "ok": {"type": "boolean"}}}


@pytest.mark.parametrize("decoding", ["saber", "cover", "wino", "llada2"])
def test_required_fields_close_in_time_after_revisions(llm, decoding) -> None:
    """A value whose shortest completion is long (three required fields) still ends valid
    when revisions roll the grammar back late in the slots: the completion estimate is
    re-read after a rollback, not kept from a later state (Saber at block length 8 once ended
    two such outputs unfinished)."""
    params = SamplingParams(max_tokens=64, block_length=8, decoding=decoding, seed=1,
                            structured_outputs=dict(json=NESTED))
    for out in llm.generate(PROMPTS[:6], params, use_tqdm=False):
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"name", "tags", "ok"} and type(value["ok"]) is bool


def test_max_tokens_below_the_shortest_value_is_warned(llm, caplog) -> None:
    import logging

    with caplog.at_level(logging.WARNING, logger="cover_vllm"):
        (out,) = llm.generate(["hello"], SamplingParams(max_tokens=16, structured_outputs=dict(
            json=NESTED)), use_tqdm=False)
    said = [r.getMessage() for r in caplog.records if "shortest value" in r.getMessage()]
    assert len(said) == 1 and "max_tokens is 16" in said[0]
    assert out.outputs[0].finish_reason == "length"          # cut, as vLLM would

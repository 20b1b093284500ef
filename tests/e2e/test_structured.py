"""Structured outputs in the engine, on a tiny random-weight Llama with SmolLM2's tokenizer: a
constrained output is valid by construction, whatever the weights. Prompts are longer than the
token budget, so they are split across SplitFuse steps, and batches mix constrained and
unconstrained requests (the latter must give the same greedy text as alone)."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastgen import FinishReason, InvalidRequestError, SamplingParams
from fastgen.engine import Engine
from fastgen.structured import check_json_schema

BUDGET = 16
PROMPT = "Give me a record, as JSON, of a person who lives in Paris and likes rivers: "  # > BUDGET tokens
FREE = SamplingParams(max_new_tokens=12, do_sample=False, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer Llama over SmolLM2's 49,152-token vocabulary, saved with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fastgen.model.loader import default_model_path, load_tokenizer

    path = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # perturbed, so that greedy text does not repeat one token
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    load_tokenizer(default_model_path()).save_pretrained(path)
    return str(path)


def make_engine(path: str, **options) -> Engine:
    return Engine.from_pretrained(path, **{"dtype": "float32", "budget_tokens": BUDGET, "block_size": 4,
                                           "num_blocks": 256, **options})


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return make_engine(tiny_dir)


def run(engine: Engine, requests: list[tuple[str, SamplingParams]]):
    ids = [engine.add_request(p, sp) for p, sp in requests]
    while engine.has_unfinished():
        engine.step()
    return [engine.response(i) for i in ids]


@pytest.fixture(scope="module")
def free_alone(engine):
    [r] = run(engine, [(PROMPT, FREE)])
    return r.generated_text


# -- random schemas, within what the grammar enforces ----------------------------------------------

NAMES = st.sampled_from(["id", "name", "tags", "x", "value", "ok", "child", "n"])
SCALARS = st.one_of(
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 5000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.one_of(st.integers(-9, 9), st.text("abc", max_size=3)), min_size=1, max_size=4,
             unique=True).map(lambda v: {"enum": v}),
    st.sampled_from([{"type": "string", "pattern": "[a-z]{1,5}"}, {"type": "string", "format": "date"},
                     {"type": "string", "format": "uuid"}, {"const": "fixed"}, {"type": ["integer", "null"]}]),
)


def _objects(children):
    return st.lists(st.tuples(NAMES, children), min_size=1, max_size=4, unique_by=lambda kv: kv[0]).flatmap(
        lambda props: st.lists(st.sampled_from([k for k, _ in props]), unique=True).map(
            lambda req: {"type": "object", "properties": dict(props), "required": req,
                         "additionalProperties": False}))


SCHEMAS = st.recursive(SCALARS, lambda children: st.one_of(
    _objects(children),
    st.tuples(children, st.integers(0, 1), st.integers(1, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}),
    st.lists(children, min_size=2, max_size=2).map(lambda s: {"anyOf": s}),
), max_leaves=6)


def validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


# derandomized: the same 12 schemas and seeds in every run, so that CI is reproducible. With a
# fresh random draw per run, about one in a few hundred requests (a random model sampling an unbounded
# number) ran past max_new_tokens: 1 failure in 5 full runs, seed 1758847, {"x": number}
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_random_schemas_give_valid_json_beside_unconstrained_requests(engine, free_alone, schema, seed):
    check_json_schema(schema)
    # Sampled, not greedy: a random model's greedy choice can loop forever inside an unbounded
    # integer; its near-uniform draws among the allowed tokens end every value soon.
    sampled = SamplingParams(max_new_tokens=384, temperature=1.0, seed=seed, json_schema=schema)
    other = SamplingParams(max_new_tokens=384, temperature=0.8, top_p=0.9, seed=seed + 1, json_schema=schema)
    rs = run(engine, [(PROMPT, other), (PROMPT, FREE), (PROMPT * 2, sampled), (PROMPT * 2, sampled),
                      ("short", other)])
    for r in (rs[0], rs[2], rs[3], rs[4]):
        assert r.finish_reason is FinishReason.STOP, (r.generated_text, r.error)
        assert r.token_ids[-1] in engine.eos_token_ids
        validate(r.generated_text, schema)
    assert rs[1].generated_text == free_alone
    assert rs[2].generated_text == rs[3].generated_text  # a seeded request's draws are its own


def test_regex_choice_and_grammar(engine, free_alone):
    regex = r"[a-z]{2,4}-\d{1,3}( [A-Z][a-z]{0,5})?"
    choices = ["yes", "no", "maybe not", "Hello, \"world\"\n"]
    reqs = [(PROMPT, SamplingParams(max_new_tokens=64, seed=s, regex=regex)) for s in range(4)]
    reqs += [(PROMPT, SamplingParams(max_new_tokens=64, seed=s, choice=choices)) for s in range(4)]
    reqs += [(PROMPT, SamplingParams(max_new_tokens=64, seed=1, grammar='root ::= "(" [0-9]{1,4} ")" | "none"')),
             (PROMPT, FREE)]
    rs = run(engine, reqs)
    assert all(r.finish_reason is FinishReason.STOP for r in rs[:-1]), [(r.generated_text, r.error) for r in rs]
    for r in rs[:4]:
        assert re.fullmatch(regex, r.generated_text), r.generated_text
    assert all(r.generated_text in choices for r in rs[4:8])
    assert re.fullmatch(r"\([0-9]{1,4}\)|none", rs[8].generated_text)
    assert rs[9].generated_text == free_alone


def test_a_grammar_that_does_not_compile_ends_only_its_request(engine, free_alone):
    rs = run(engine, [(PROMPT, SamplingParams(max_new_tokens=8, grammar='root ::= "a" | ')),
                      (PROMPT, SamplingParams(max_new_tokens=8, regex="(ab")),
                      (PROMPT, SamplingParams(max_new_tokens=8, json_schema={"type": "object", "minProperties": 2})),
                      (PROMPT, FREE)])
    for r, param in zip(rs, ("grammar", "regex", "json_schema")):
        assert r.finish_reason is FinishReason.ERROR and r.generated_length == 0
        assert r.error.startswith(f"{param}: cannot be compiled"), r.error
    assert rs[3].generated_text == free_alone and rs[3].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"if": {"type": "string"}}}}, "if"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "oneOf"),
    ({"allOf": [{"type": "integer"}]}, "allOf"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"type": "string", "format": "credit-card"}, "credit-card"),
    ({"type": "strin"}, "strin"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "array", "items": {"type": "object", "dependentRequired": {}}}, "#/items"),
])
def test_unsupported_schema_features_are_refused_by_name(schema, keyword):
    with pytest.raises(InvalidRequestError, match=re.escape(keyword)) as e:
        SamplingParams(json_schema=schema)
    assert e.value.param == "json_schema"


def test_bad_constraint_arguments_are_refused():
    for kwargs, param in [(dict(regex="a", choice=["a"]), "choice"), (dict(choice=[]), "choice"),
                          (dict(choice=["a", 3]), "choice"), (dict(regex=""), "regex"),
                          (dict(json_schema="{not json"), "json_schema"), (dict(json_schema=[1]), "json_schema"),
                          (dict(json_object=True, ignore_eos=True), "ignore_eos"),
                          (dict(regex="a+", min_new_tokens=2), "min_new_tokens")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param, (kwargs, e.value)


def test_preempted_constrained_requests_keep_their_matchers(tiny_dir):
    """A pool too small for all of them: requests are preempted and recomputed (their generated
    tokens kept) and their matchers are not advanced again (the engine asserts it each step)."""
    engine = make_engine(tiny_dir, num_blocks=40, reserve_blocks=0)
    # v bounded: a random model's draws inside an unbounded integer can run past max_new_tokens
    schema = {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3},
                                                                         "v": {"type": "integer", "minimum": -999,
                                                                               "maximum": 999}},
                                         "required": ["k", "v"]}, "minItems": 4, "maxItems": 5}
    rs = run(engine, [(PROMPT, SamplingParams(max_new_tokens=120, seed=s, json_schema=schema)) for s in range(6)])
    assert sum(r.num_preemptions for r in rs) > 0
    for r in rs:
        assert r.finish_reason is FinishReason.STOP, (r.generated_text, r.error)
        validate(r.generated_text, schema)


def test_a_compiling_request_waits_outside_the_scheduler_and_does_not_stall_others(engine, free_alone):
    gate = threading.Event()
    compile_ = engine.grammars.compile

    def slow_compile(spec):
        gate.wait(30)
        return compile_(spec)

    engine.grammars.compile = slow_compile
    try:
        slow = engine.add_request(PROMPT, SamplingParams(max_new_tokens=16, regex="[0-9]{3}"))
        free = engine.add_request(PROMPT, FREE)
        done = False
        while not done:
            outs = engine.step()
            assert all(o.request_id != slow for o in outs)
            assert engine.stats().num_waiting >= 1  # the compiling request counts as waiting
            done = any(o.request_id == free and o.finish_reason is not None for o in outs)
        assert engine.response(free).generated_text == free_alone
        gate.set()
        while engine.has_unfinished():
            engine.step()
        r = engine.response(slow)
        assert r.finish_reason is FinishReason.STOP and re.fullmatch("[0-9]{3}", r.generated_text)
        # aborted while compiling: it ends at once and never reaches the scheduler
        gate.clear()
        rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=16, regex="[0-9]{4}"))
        engine.abort(rid)
        assert not engine.has_unfinished() and engine.response(rid).finish_reason is FinishReason.ABORT
    finally:
        gate.set()
        engine.grammars.compile = compile_


def test_masks_equal_xgrammars_own_and_touch_only_constrained_rows(engine):
    import xgrammar as xgr

    from fastgen.structured import apply_grammar_masks

    vocab = engine.model_config.vocab_size
    states = []
    for p in (SamplingParams(regex=r"[a-c]+\d"), SamplingParams(json_schema={"type": "integer"}),
              SamplingParams(choice=["Paris", "Rome"])):
        compiled = engine.grammars.compile(p.structured)
        states.append(engine.grammars.matcher(compiled))
    assert states[0].accept(engine.tokenizer.encode("ab", add_special_tokens=False)[0])
    logits = torch.randn(5, vocab)
    rows = [(1, states[0]), (2, states[1]), (4, states[2])]
    got = logits.clone()
    apply_grammar_masks(got, rows)
    want = logits.clone()
    bitmask = xgr.allocate_token_bitmask(5, vocab)
    for i, s in rows:
        s.fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=[1, 2, 4])
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 3]], logits[[0, 3]])
    assert 0 < int(torch.isfinite(got[1]).sum()) < vocab


def test_json_never_holds_a_raw_control_character(engine):
    """xgrammar 0.2.9 lets control characters into length-limited strings; fastgen forbids every
    token holding one in JSON modes (GrammarCompiler.control_token_ids), whatever the schema."""
    banned = engine.grammars.control_token_ids
    assert banned.numel() > 0 and 194 in banned.tolist()        # SmolLM2's byte token for \x05
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
    spec = SamplingParams(json_schema=schema).structured
    state = engine.grammars.matcher(engine.grammars.compile(spec), spec)
    for tok in engine.tokenizer.encode('{"name": "', add_special_tokens=False):
        assert state.accept(tok)
    from fastgen.structured import grammar_bias
    bias = grammar_bias([(0, state)], engine.model_config.vocab_size)[0]
    assert torch.isinf(bias[banned]).all()
    allowed = torch.isfinite(bias).nonzero().squeeze(1).tolist()
    vocab = engine.grammars.tokenizer_info.decoded_vocab      # a copy of the whole vocabulary: read once
    assert allowed and all(not any(c < 0x20 for c in vocab[i]) for i in allowed)
    # without the JSON spec (a regex or grammar may want control characters) nothing extra is banned
    plain = engine.grammars.matcher(engine.grammars.compile(spec))
    assert plain.banned is None


def test_a_step_whose_logits_are_not_numbers_ends_its_requests_by_name_and_the_engine_serves_on(tiny_dir):
    """A row with nothing to sample (here: one forward's logits made NaN) ends its request with an
    error that names what was left (finite logits, tokens the constraint allows); before, torch's
    argmax or the draw's clamp picked a token and a constrained request failed on its matcher
    ("the output constraint rejected token 49151"). The blocks come back and the next requests
    are served as before."""
    engine = make_engine(tiny_dir)
    [before] = run(engine, [(PROMPT, FREE)])
    forward = engine.model
    poisoned = []

    def poison(batch, pool):
        out = forward(batch, pool)
        if not poisoned and out.shape[0] == 2:      # the first step in which both requests sample
            poisoned.append(True)
            out = torch.full_like(out, float("nan"))
        return out

    engine.model = poison
    try:
        rs = run(engine, [(PROMPT, SamplingParams(max_new_tokens=8, seed=0, choice=["yes", "no"])), (PROMPT, FREE)])
    finally:
        engine.model = forward
    assert poisoned
    for r in rs:
        assert r.finish_reason is FinishReason.ERROR, r
        assert r.error.startswith("no token could be sampled") and "hold 0 finite values of 49152" in r.error
    allowed = re.search(r"the output constraint allows (\d+) tokens after 0 generated", rs[0].error)
    assert allowed and int(allowed[1]) > 0 and "allows" not in rs[1].error
    assert rs[0].generated_length == 0   # the free request may have sampled before (its prompt needs no compile)
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    [after] = run(engine, [(PROMPT, FREE)])
    assert after.generated_text == before.generated_text

"""Token-in, token-out context: each turn tokenized once, generated ids kept as generated, cuts rebuildable."""

from __future__ import annotations

import pytest

from rollout.context import ChatEncoder, ChatTemplateError, TokenContext, model_input_of
from rollout.model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_stream_renders_the_chat_template_turn_by_turn(tok):
    enc = ChatEncoder.from_tokenizer(tok)
    ctx = TokenContext(enc, max_prompt_tokens=10_000)
    prompt = ctx.begin("Solve 2+2.")
    ctx.add_action(_ids(tok, "CALC 2+2") + [tok.eos_token_id])  # stopped on EOS: it closed its own turn
    obs = ctx.add_observation("2+2 = 4")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Solve 2+2."}, {"role": "assistant", "content": "CALC 2+2"},
         {"role": "tool", "content": "2+2 = 4"}], tokenize=False, add_generation_prompt=True)
    # Same text as the template renders the whole conversation; the prompt carries the only BOS.
    assert tok.decode(ctx.stream) == text
    assert prompt[0] == tok.bos_token_id and ctx.stream.count(tok.bos_token_id) == 1
    assert tok.decode(obs) == "\n<|tool|>\n2+2 = 4<|eos|>\n<|assistant|>\n"
    assert ctx.model_input().ids == ctx.stream and ctx.model_input().cut_tokens == 0


def test_generated_ids_are_kept_even_when_retokenizing_would_merge_them(tok):
    enc = ChatEncoder.from_tokenizer(tok)
    ctx = TokenContext(enc, max_prompt_tokens=10_000)
    ctx.begin("go")
    # "ANSWER" is one BPE token; a model may still emit it as two pieces. Re-tokenizing the text
    # would give the merged id: the context must keep what the model produced.
    pieces = _ids(tok, "ANS") + _ids(tok, "WER")
    assert _ids(tok, "ANSWER") != pieces
    ctx.add_action(pieces)
    assert ctx.stream[-len(pieces):] == pieces


def test_an_action_without_eos_gets_the_turn_closed_in_the_observation(tok):
    enc = ChatEncoder.from_tokenizer(tok)
    ctx = TokenContext(enc, max_prompt_tokens=10_000)
    ctx.begin("go")
    ctx.add_action(_ids(tok, "CALC 1"))  # hit max_tokens: no EOS
    obs = ctx.add_observation("1")
    assert obs[0] == tok.eos_token_id and tok.decode(obs) == "<|eos|>\n<|tool|>\n1<|eos|>\n<|assistant|>\n"


def test_cut_keeps_the_prompt_head_and_newest_turns_and_is_rebuilt_from_the_steps(tok):
    enc = ChatEncoder.from_tokenizer(tok)
    budget = 40
    ctx = TokenContext(enc, max_prompt_tokens=budget)
    observations, actions, windows = [ctx.begin("Compute the total of the invoice.")], [], []
    for k in range(6):
        windows.append(ctx.model_input())
        action = _ids(tok, f"CALC {k} + {k}") + [tok.eos_token_id]
        actions.append(action)
        ctx.add_action(action)
        observations.append(ctx.add_observation(f"{k} + {k} = {2 * k}"))
    windows.append(ctx.model_input())
    assert windows[0].cut_tokens == 0 and windows[-1].cut_tokens > 0
    for k, w in enumerate(windows[:-1]):
        assert len(w.ids) <= budget
        # The step records (observation ids, action ids, cut) rebuild exactly what the model was fed.
        assert model_input_of(observations, actions, step=k, cut_start=w.cut_start, cut_tokens=w.cut_tokens) == w.ids
        if w.cut_tokens:
            head = len(observations[0])
            assert w.cut_start == min(head, budget // 2) and w.ids[:w.cut_start] == observations[0][:w.cut_start]
    # Newest tokens survive: the input ends with the last observation's assistant marker.
    last = windows[-1]
    assert last.ids[-len(observations[-1]):] == observations[-1]


def test_a_template_that_rewrites_past_turns_is_refused(tok):
    rewriting = build_tokenizer()
    # Drops the content of earlier assistant turns (as "thinking" templates do): not renderable turn by turn.
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|assistant|>\n<|eos|>\n"
        "{% else %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|eos|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    with pytest.raises(ChatTemplateError, match="re-renders earlier turns"):
        ChatEncoder.from_tokenizer(rewriting)

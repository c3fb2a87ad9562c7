"""A tiny Llama-architecture base model and tokenizer, built from scratch (no downloads).

:func:`init_tiny_model` writes a directory that ``transformers``
(``AutoTokenizer`` / ``AutoModelForCausalLM``) and ``vllm.LLM(model=DIR)``
both load:

* ``config.json`` + ``model.safetensors``: a randomly initialised
  ``LlamaForCausalLM`` (float32; 2 layers, hidden 128, 2 heads of dim 64 by
  default: vLLM's CPU attention backend rejects head dims below 32, and 64 is
  its smallest well-trodden size).
* ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE trained with
  the ``tokenizers`` library on a generated corpus of the rollout domains'
  vocabulary (Python code, shell commands, arithmetic, finance words, the
  environments' action verbs). Byte-level, so any text round-trips. Special
  tokens: ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` and the role markers
  ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|tool|>`` (the roles of
  :class:`rollout.policies.base.Message`); a chat template renders a
  conversation as ``<|bos|><|user|>\\n...<|eos|>\\n<|assistant|>\\n``.
  The tokenizer adds **no** special tokens by itself: the chat template adds
  ``<|bos|>``, so prompts are not double-prefixed whichever engine encodes them.
* ``generation_config.json`` naming BOS/EOS/PAD.

Everything is a function of the arguments: the same seed writes byte-identical
files (the corpus is generated from a fixed-seed ``random.Random``; BPE training
on a fixed corpus is deterministic; weights come from ``torch.manual_seed(seed)``).
The tokenizer is the same for every weight seed, so models of different seeds
are interchangeable policy versions.

Examples:
    >>> corpus = build_corpus(seed=0, lines=50)
    >>> corpus == build_corpus(seed=0, lines=50), len(corpus)
    (True, 50)
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "build_corpus",
    "build_tokenizer",
    "count_parameters",
    "init_tiny_model",
    "step_seed",
]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
#: Special tokens, in id order (ids 0..5).
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

#: Jinja chat template (the ``transformers`` convention); every message ends with EOS,
#: so a model that learned the format stops at EOS after its answer.
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|eos|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_PY_SNIPPETS = [
    "def {f}({a}, {b}):\n    return {a} {op} {b}\n",
    "def {f}({a}):\n    total = 0\n    for x in {a}:\n        total += x\n    return total\n",
    "def {f}(s):\n    return ''.join(reversed(s))\n",
    "def {f}({a}):\n    if not {a}:\n        return None\n    return max({a})\n",
    "from collections import Counter\n\ndef {f}(words, k):\n    return [w for w, _ in Counter(words).most_common(k)]\n",
    "def {f}(s):\n    stack = []\n    for ch in s:\n        if ch in '([{{':\n            stack.append(ch)\n    return not stack\n",
    "import sys\nprint({f}({a}={n}))\n",
    "assert {f}({n}, {m}) == {r}, 'expected {r}'\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    "try:\n    value = int({a})\nexcept ValueError as err:\n    print(err)\n",
]
_SHELL = [
    "RUN python3 solution.py", "RUN ls -la", "RUN cat {file}", "RUN mkdir -p out && sort {file} > out/sorted.txt",
    "RUN tr a-z A-Z < {file} > out/upper.txt", "RUN awk -F, '{{s[$1]+=$2}} END {{for (k in s) print k\",\"s[k]}}' {file}",
    "RUN grep -o 'E[0-9]*' logs/*.log | sort | uniq -c | sort -rn | head -3", "RUN wc -l {file}",
    "RUN cut -d, -f1 {file} | uniq", "RUN python3 -m pytest -q", "TEST", "SUBMIT", "CHECK", "DONE", "ROLLBACK",
    "WRITE solution.py", "WRITE out/{file}",
]
_FINANCE = [
    "revenue", "operating income", "net income", "gross margin", "operating margin", "fiscal year", "FY2022",
    "FY2023", "FY2024", "segment", "balance sheet", "income statement", "total assets", "liabilities",
    "equity", "cash flow", "quarterly revenue", "Q1", "Q2", "Q3", "Q4", "growth", "percentage points",
    "USD millions", "Cloud Services", "Consumer Devices", "Enterprise Software", "Payments", "Logistics",
    "Advertising", "Healthcare IT", "Industrial Sensors", "peer comparison", "annual report", "ratio",
    "discount", "tax", "interest", "compound interest", "principal", "rate", "price", "average speed",
]
_MATH_WORDS = ["CALC", "STATE", "ANSWER", "SEARCH", "LOOKUP", "CITE", "total", "cost", "subtotal",
               "discount", "price_after_discount", "tax", "speed", "distance", "time", "x", "y"]
_NAMES = ["add", "mul", "sub", "count_words", "reverse", "top_k", "rle", "balanced", "solve", "parse",
          "mean", "median", "clip", "fizz", "buzz", "merge", "split_csv", "total"]
_VARS = ["a", "b", "n", "xs", "items", "text", "nums", "values", "data", "line", "row"]
_FILES = ["input.txt", "data.csv", "sales.csv", "logs/app.log", "words.txt", "report.md"]


def build_corpus(*, seed: int = 0, lines: int = 6000) -> list[str]:
    """A generated training corpus for the tokenizer: code, shell, arithmetic, finance, actions.

    Args:
        seed: RNG seed; the same seed gives the same corpus.
        lines: number of documents (each one line or one small snippet).

    Returns:
        The documents.
    """
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = i % 5
        n, m = rng.randint(0, 999), rng.randint(1, 99)
        if kind == 0:
            out.append(rng.choice(_PY_SNIPPETS).format(
                f=rng.choice(_NAMES), F=rng.choice(_NAMES).title().replace("_", ""), a=rng.choice(_VARS),
                b=rng.choice(_VARS), op=rng.choice("+-*/%"), n=n, m=m, r=n + m))
        elif kind == 1:
            out.append(rng.choice(_SHELL).format(file=rng.choice(_FILES)))
        elif kind == 2:
            op = rng.choice(["+", "-", "*", "/", "**"])
            if op == "**":
                base, exp = round(1 + m / 100, 2), rng.randint(1, 5)
                expr, value = f"({base:.2f}) ** {exp}", base**exp
            else:
                expr, value = f"{n} {op} {m}", {"+": n + m, "-": n - m, "*": n * m, "/": n / m}[op]
            out.append(rng.choice([f"CALC {expr}", f"STATE {rng.choice(_MATH_WORDS[6:])} = {n}.{m:02d}",
                                   f"ANSWER {n}.{m:02d}", f"{expr} = {value:.2f}"]))
        elif kind == 3:
            words = rng.sample(_FINANCE, 4)
            out.append(f"{words[0]} | {words[1]} | FY{rng.randint(2019, 2025)} = {n}.{m:02d}; "
                       f"{words[2]} rose {m}% while {words[3]} was {n} USD millions.")
        else:
            table = rng.choice(["Segment revenue", "Income statement", "Balance sheet", "Quarterly revenue"])
            out.append(rng.choice([f"LOOKUP {table}", f"SEARCH {rng.choice(_FINANCE)}",
                                   f"CITE {table} | {rng.choice(_FINANCE)} | FY{rng.randint(2022, 2024)} = {n}",
                                   f"The {rng.choice(_FINANCE)} was {n} and the {rng.choice(_FINANCE)} was {m}."]))
    return out


def build_tokenizer(*, vocab_size: int = 2048, seed: int = 0):
    """Train a byte-level BPE on :func:`build_corpus` and wrap it as a ``PreTrainedTokenizerFast``.

    Args:
        vocab_size: size of the final vocabulary, special tokens and the 256 byte symbols included.
        seed: corpus seed.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with BOS/EOS/PAD and :data:`CHAT_TEMPLATE`.

    Raises:
        ValueError: ``vocab_size`` cannot hold the specials plus the byte alphabet.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"`vocab_size` must be >= {floor} (specials + 256 byte symbols), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(build_corpus(seed=seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=CHAT_TEMPLATE,
        model_max_length=2048, padding_side="left", clean_up_tokenization_spaces=False,
    )


def count_parameters(model) -> int:
    """Number of parameters of a torch module."""
    return sum(p.numel() for p in model.parameters())


def init_tiny_model(
    out: Path,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised tiny Llama model and its from-scratch tokenizer to ``out``.

    Args:
        out: target directory (created; existing model files are overwritten).
        vocab_size: tokenizer and embedding size (BPE may learn fewer merges on a
            small corpus; the model's embedding is sized to the tokenizer's real length).
        hidden_size: model width; ``hidden_size / num_heads`` is the head dim.
        num_layers: decoder layers.
        num_heads: attention heads (and KV heads: plain multi-head attention).
        intermediate_size: MLP width.
        max_position_embeddings: longest sequence (prompt + generation), tokens.
        seed: seed of the weights (the tokenizer is the same for every seed).

    Returns:
        ``out``.

    Raises:
        ValueError: ``hidden_size`` not divisible by ``num_heads``, or a head dim
            vLLM's CPU attention cannot run (below 32 or not a multiple of 16).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"`hidden_size` {hidden_size} must be divisible by `num_heads` {num_heads}")
    head_dim = hidden_size // num_heads
    if head_dim < 32 or head_dim % 16:
        raise ValueError(f"head dim {head_dim} (= hidden_size / num_heads) is not one vLLM's CPU attention runs; "
                         "use 64, e.g. --hidden-size 128 --num-heads 2")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The tokenizer does not depend on `seed`: models of any seed (and every policy
    # version trained from them) share one vocabulary and stay interchangeable.
    tokenizer = build_tokenizer(vocab_size=vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN],
        tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN],
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "trajpipe_model.json").write_text(json.dumps({
        "kind": "tiny-llama-random-init", "seed": seed, "params": count_parameters(model),
        "vocab_size": len(tokenizer), "head_dim": head_dim,
    }, indent=1, sort_keys=True) + "\n")
    return out


def step_seed(seed: int, task_id: str, step_index: int, *, sample: str = "") -> int:
    """Sampling seed of one policy call: a hash of (policy seed, task, sample, step), in ``[0, 2**31)``.

    Independent of the order episodes run in, so a rollout is reproducible at
    any concurrency. ``sample`` names which sample of the task this episode is
    (the scheduler's group round, the member index in the group, the retry
    attempt): the members of a GRPO group draw different actions from the same
    prompt, while the same (seed, task, sample, step) always samples the same
    action.

    Examples:
        >>> step_seed(0, "math-d0-abc", 1) == step_seed(0, "math-d0-abc", 1)
        True
        >>> step_seed(0, "math-d0-abc", 1) == step_seed(1, "math-d0-abc", 1)
        False
        >>> step_seed(0, "math-d0-abc", 1, sample="0.0.0") == step_seed(0, "math-d0-abc", 1, sample="0.1.0")
        False
    """
    key = f"{seed}\x1f{task_id}\x1f{step_index}" + (f"\x1f{sample}" if sample else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 31)

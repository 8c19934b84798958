"""Train `cover-tiny`: a small LLaDA-architecture masked diffusion LM on the synthetic tasks.

Builds the vocabulary (a byte-level BPE over printable ASCII with one token per digit and per
punctuation mark, learned on task text), trains with the LLaDA SFT loss on a mixture of
`cover_vllm.tasks`, and writes an HF-format directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json). Deterministic for a given --seed and thread count.

    PYTHONPATH=. python examples/train_cover_tiny.py --out DIR   (see docs/cover_tiny.md for the
    two-stage command that produced the shipped checkpoint)

LLaDA SFT (Nie et al., 2025, §2.3 / Eq. 5): per sample t ~ U(eps, 1); every answer token (incl.
the EOS padding) is masked with probability t; the prompt is never masked; the loss is the
cross-entropy on masked answer tokens weighted by 1/t, divided by the answer length.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cover_vllm.models.llada import LLaDAModelLM
from cover_vllm.models.loader import init_dummy_weights, load_weights
from cover_vllm.models.spec import ModelSpec
from cover_vllm.tasks import Example, Task, get_task

PAD, EOS, MASK, UNK = "<|pad|>", "<|endoftext|>", "<|mdm_mask|>", "<|unk|>"
ROLES = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIALS = [PAD, EOS, MASK, UNK, *ROLES.values()]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{% elif m['role'] == 'user' %}<|user|>"
    "{% else %}<|assistant|>{% endif %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# words (with an optional leading space) | one digit | one whitespace char | one other char
PIECES = r" ?[A-Za-z]+|\d|\s|[^\sA-Za-z\d]"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="cover_vllm/assets/cover-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--mix", default="sudoku4=0.4,arith=0.35,word=0.25",
                   help="task=weight,... (sampling probabilities per example)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=384)
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (and save) after this many steps of the --steps schedule")
    p.add_argument("--init-from", default=None,
                   help="continue from this checkpoint dir (its tokenizer and weights)")
    return p.parse_args()


def parse_mix(text: str) -> list[tuple[Task, float]]:
    mix = []
    for item in text.split(","):
        name, _, weight = item.partition("=")
        if not weight:
            raise ValueError(f"--mix item {item!r} is not task=weight")
        mix.append((get_task(name.strip()), float(weight)))
    return mix


def build_tokenizer(mix: list[tuple[Task, float]], vocab_size: int, seed: int) -> Tokenizer:
    """Byte-level BPE: printable ASCII + \\n\\t as the alphabet, merges learned on task text."""
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(PIECES), behavior="isolated"), level])
    tok.decoder = decoders.ByteLevel()
    ascii_chars = "".join(chr(i) for i in range(32, 127)) + "\n\t"
    alphabet = sorted({ch for piece, _ in level.pre_tokenize_str(ascii_chars) for ch in piece})
    rng = random.Random(seed)
    corpus = [text for task, _ in mix for _ in range(2000)
              for ex in [task.sample(rng)] for text in (ex.prompt, ex.answer)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=alphabet, min_frequency=20,
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, mask_token=MASK, unk_token=UNK,
        additional_special_tokens=list(ROLES.values()), chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=max_len)
    fast.save_pretrained(str(out), save_jinja_files=False)
    return AutoTokenizer.from_pretrained(str(out))


def model_config(args: argparse.Namespace, tok: Tokenizer, max_len: int) -> dict:
    vocab = tok.get_vocab_size()
    return {
        "model_type": "llada", "architectures": ["LLaDAModelLM"],
        "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
        "n_kv_heads": args.n_heads, "mlp_hidden_size": args.mlp,
        "vocab_size": vocab, "embedding_size": vocab,
        "mask_token_id": tok.token_to_id(MASK), "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD), "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "max_sequence_length": max_len, "include_bias": False, "weight_tying": False,
        "torch_dtype": "float32", "default_block_length": 32,
    }


class Batcher:
    """Samples a task mixture (skipping held-out prompts) into padded LLaDA SFT batches."""

    def __init__(self, mix: list[tuple[Task, float]], tok: Tokenizer, seed: int):
        self.tasks = [t for t, _ in mix]
        self.weights = [w for _, w in mix]
        self.held_out = {t.name: t.eval_prompts(1000) for t in self.tasks}
        self.tok, self.rng = tok, random.Random(seed)
        self.eos, self.pad = tok.token_to_id(EOS), tok.token_to_id(PAD)

    def encode(self, task: Task, ex: Example) -> tuple[list[int], list[int]]:
        prompt = self.tok.encode(ROLES["user"] + ex.prompt + ROLES["assistant"]).ids
        answer = self.tok.encode(ex.answer).ids + [self.eos]
        if len(answer) > task.max_tokens:
            raise ValueError(f"{task.name}: answer of {len(answer)} tokens > {task.max_tokens}")
        return prompt, answer + [self.eos] * (task.max_tokens - len(answer))

    def sample(self) -> tuple[Task, Example]:
        task = self.rng.choices(self.tasks, self.weights)[0]
        while True:
            ex = task.sample(self.rng)
            if ex.prompt not in self.held_out[task.name]:
                return task, ex

    def batch(self, size: int) -> list[dict[str, torch.Tensor]]:
        """`size` examples, grouped into one right-padded sub-batch per task (less padding)."""
        by_task: dict[str, list[tuple[list[int], list[int]]]] = {}
        for _ in range(size):
            task, ex = self.sample()
            by_task.setdefault(task.name, []).append(self.encode(task, ex))
        return [self._pad(rows) for _, rows in sorted(by_task.items())]

    def _pad(self, rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), length), self.pad, dtype=torch.long)
        is_answer = torch.zeros(len(rows), length, dtype=torch.bool)
        valid = torch.zeros(len(rows), length, dtype=torch.bool)
        for i, (p, a) in enumerate(rows):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            valid[i, :len(p) + len(a)] = True
            is_answer[i, len(p):len(p) + len(a)] = True
        return {"ids": ids, "is_answer": is_answer, "valid": valid}


def sft_loss(model: LLaDAModelLM, batch: dict[str, torch.Tensor], mask_id: int,
             gen: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    """Summed LLaDA SFT loss (Eq. 5) of one sub-batch; the caller divides by the batch size."""
    ids, is_answer, valid = batch["ids"], batch["is_answer"], batch["valid"]
    t = (1 - eps) * torch.rand(ids.shape[0], 1, generator=gen) + eps          # [B, 1]
    masked = (torch.rand(ids.shape, generator=gen) < t) & is_answer           # [B, L]
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    logits = model(noisy, attention_mask=None if bool(valid.all()) else valid)  # [B, L, V]
    ce = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none")       # [B, L]
    answer_len = is_answer.sum(1, keepdim=True).clamp(min=1)
    return (ce * masked / t / answer_len).sum()


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10 % of --lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def save_model(model: LLaDAModelLM, config: dict, out: Path) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mix = parse_mix(args.mix)
    max_len = 128
    if args.init_from:
        tok = Tokenizer.from_file(str(Path(args.init_from) / "tokenizer.json"))
    else:
        tok = build_tokenizer(mix, args.vocab_size, args.seed)
    save_tokenizer(tok, out, max_len)
    config = model_config(args, tok, max_len)
    model = LLaDAModelLM(ModelSpec.from_config(config))
    init_dummy_weights(model, seed=args.seed)
    if args.init_from:
        load_weights(model, Path(args.init_from))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {config['vocab_size']}, params {num_params / 1e6:.3f} M", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    batcher = Batcher(mix, tok, args.seed + 1)
    gen = torch.Generator().manual_seed(args.seed + 2)
    start, running = time.time(), 0.0
    model.train()
    for step in range(min(args.steps, args.stop_after or args.steps)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for sub in batcher.batch(args.batch_size):    # gradient accumulation over tasks
            sub_loss = sft_loss(model, sub, config["mask_token_id"], gen) / args.batch_size
            sub_loss.backward()
            loss += sub_loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = (step % args.log_every) + 1
            print(f"step {step + 1:5d}  loss {running / n:.4f}  lr {lr_at(step, args):.2e}  "
                  f"{time.time() - start:6.0f}s", flush=True)
            running = 0.0
            save_model(model, config, out)
    save_model(model, config, out)
    print(f"done: {step + 1} steps in {time.time() - start:.0f}s -> {out}", flush=True)


if __name__ == "__main__":
    main()

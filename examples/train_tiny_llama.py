#!/usr/bin/env python3
"""Train the tiny demo checkpoint shipped in ``examples/tiny-llama/``.

Everything runs on CPU, from the public-domain KJV text in ``examples/data/``:

1. a byte-level BPE tokenizer (``tokenizers``, vocab 4096, special tokens
   ``<s>`` / ``</s>`` / ``<pad>``) trained on ``train.txt`` only and saved in
   transformers format (``PreTrainedTokenizerFast``);
2. a ``LlamaForCausalLM`` with grouped-query attention (hidden 256, 4 layers,
   8 query heads, 2 KV heads, head_dim 32, MLP 688, tied embeddings,
   max_position_embeddings 2048, rope_theta 10000);
3. AdamW + linear warm-up + cosine decay on random windows of the training
   token stream: short windows first (cheap), then ``--seq-len`` (2048, the
   configured context) windows for the last ``--long-frac`` of the steps, so that
   every position the config claims is trained;
4. ``save_pretrained(safe_serialization=True)`` + ``generation_config.json``.
   By default the weights are stored as bfloat16 (to keep the demo small) while
   ``config.json`` keeps ``dtype: float32``, so ``from_pretrained`` loads them
   into float32;
5. evaluation of the *saved* checkpoint (reloaded from disk): held-out
   perplexity = exp(token-weighted mean NLL) over non-overlapping ``--seq-len``-token
   windows of the ``heldout.txt`` token stream (the first token of each window
   is not scored), and the perplexity of a unigram model (add-one smoothed
   counts over the training token stream) on exactly the same scored tokens.

Token streams: every file is split into books (separated by two blank lines);
each book is encoded as ``<s> text </s>`` and the books are concatenated.

Reproduce the shipped checkpoint (1 CPU thread; took 8m49s wall on a shared
2-core Xeon with AMX, bf16 autocast):

    OMP_NUM_THREADS=1 python examples/train_tiny_llama.py --threads 1 \
        --output examples/tiny-llama

The larger base of ``benchmarks/fidelity.py`` (26M parameters, GQA 8:2, head_dim 64, context 2048; about
two minutes on one H100/H200) is the same script with other sizes; the benchmark runs it when its
checkpoint is missing (see ``FIDELITY_BASE_ARGS`` there). ``--extra-train examples/data/commentaries.txt.xz``
adds 3.66M tokens of public-domain commentary to the 0.93M of KJV (the DCA bar's base: KJV alone is memorised
before a 26M model breaks down past its trained context).

Only evaluate an existing checkpoint:

    python examples/train_tiny_llama.py --eval-only --output examples/tiny-llama
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(HERE / "data"))
    p.add_argument("--extra-train", action="append", default=[], metavar="FILE",
                   help="more training documents (.txt or .txt.xz, separated by two blank lines), e.g. "
                        "examples/data/commentaries.txt.xz; the tokenizer is trained on them too; repeatable")
    p.add_argument("--output", default=str(HERE / "tiny-llama"))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=640, help="total optimizer steps")
    p.add_argument("--long-frac", type=float, default=0.25,
                   help="fraction of the steps (at the end) trained on --seq-len windows")
    p.add_argument("--short-len", type=int, default=256, help="window length of the first phase")
    p.add_argument("--seq-len", type=int, default=2048, help="window length of the last phase (and eval)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--autocast-bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the training forward/backward (master weights stay fp32)")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the tensors in model.safetensors")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0,
                   help="RoPE base (Llama 3 uses 500000: more of the slow channels never turn a full period within "
                        "the training length)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (bf16 autocast on either)")
    p.add_argument("--passkey-frac", type=float, default=0.0,
                   help="fraction of each batch's windows replaced by passkey prompts in the format of cca-convert's "
                        "validator (random keys and depths), so that the model learns retrieval within its context "
                        "(the DCA row of benchmarks/fidelity.py measures it past that context)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-only", action="store_true", help="only evaluate the checkpoint in --output")
    return p.parse_args()


# --------------------------------------------------------------------------- data

def read_books(path):
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (examples/data/README.md says how each corpus is built)")
    if path.suffix == ".xz":
        import lzma

        text = lzma.decompress(path.read_bytes()).decode("utf-8")
    else:
        text = path.read_text(encoding="utf-8")
    books = [b.strip("\n") + "\n" for b in text.split("\n\n\n") if b.strip()]
    return books


def encode_books(tokenizer, books):
    """<s> book </s> for every book, concatenated into one int64 stream."""
    ids = []
    for book in books:
        ids.append(tokenizer.bos_token_id)
        ids.extend(tokenizer(book, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def train_tokenizer(train_books, vocab_size, out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_books, trainer=trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert (bos, eos, tok.token_to_id("<pad>")) == (0, 1, 2)
    # tokenizer(text) prepends <s> (like Llama); no </s> is appended.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                      special_tokens=[("<s>", bos)]),
    ])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out_dir)
    return hf_tok


# --------------------------------------------------------------------------- model

def build_model(args, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim or args.hidden // args.heads,
        hidden_act="silu",
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    return model


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def passkey_windows(tokenizer, count, seq, step, seed):
    """``count`` passkey prompts of exactly ``seq`` tokens (validator format, digits keys at random depths); the
    keys come from this step's own seed, never the validator's."""
    from cca_convert.validate.passkey import make_trials

    rng = random.Random(f"passkey-train-{seed}-{step}")
    trials = [make_trials(tokenizer, seq, [rng.random()], 1, 5, f"train-{seed}-{step}-{i}") for i in range(count)]
    if not all(trials):
        raise SystemExit(f"--passkey-frac: a passkey prompt does not fit in {seq} tokens; raise --short-len")
    return torch.stack([t[0].input_ids for t in trials])


def train(args, model, train_ids, tokenizer=None):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    long_start = args.steps - int(round(args.long_frac * args.steps))
    n = len(train_ids)
    model.train()
    t0 = time.time()
    tokens_seen = 0
    for step in range(args.steps):
        seq = args.seq_len if step >= long_start else args.short_len
        bsz = max(1, args.batch_tokens // seq)
        starts = torch.randint(0, n - seq - 1, (bsz,), generator=gen)
        batch = torch.stack([train_ids[s:s + seq] for s in starts.tolist()])
        n_passkey = round(args.passkey_frac * bsz)
        if n_passkey:
            batch[:n_passkey] = passkey_windows(tokenizer, n_passkey, seq, step, args.seed)
        batch = batch.to(args.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.autocast_bf16):
            logits = model(input_ids=batch).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tokens_seen += batch.numel()
        if step % args.log_every == 0 or step == args.steps - 1 or step == long_start:
            el = time.time() - t0
            print(f"step {step:5d}/{args.steps} seq {seq:4d} loss {loss.item():.4f} "
                  f"lr {lr_at(step, args):.2e} tokens {tokens_seen:,} elapsed {el:7.1f}s "
                  f"({tokens_seen / el:,.0f} tok/s)", flush=True)
    return time.time() - t0, tokens_seen


def save_checkpoint(model, out_dir, save_dtype):
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    if save_dtype != "float32":
        # Store the tensors in bf16 but keep config.dtype = float32: from_pretrained
        # (dtype="auto") then loads the (bf16-rounded) weights into float32.
        path = Path(out_dir) / "model.safetensors"
        sd = load_file(str(path))
        sd = {k: v.to(getattr(torch, save_dtype)).contiguous() for k, v in sd.items()}
        save_file(sd, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------- eval

@torch.no_grad()
def evaluate(model, heldout_ids, train_ids, vocab_size, window):
    model.eval()
    total_nll, total_tok = 0.0, 0
    targets = []
    for s in range(0, len(heldout_ids), window):
        chunk = heldout_ids[s:s + window]
        if len(chunk) < 2:
            continue
        logits = model(input_ids=chunk[None]).logits[0, :-1].float()
        tgt = chunk[1:]
        total_nll += torch.nn.functional.cross_entropy(logits, tgt, reduction="sum").item()
        total_tok += len(tgt)
        targets.append(tgt)
    targets = torch.cat(targets)
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    uni_nll = -logp[targets].sum().item()
    return math.exp(total_nll / total_tok), math.exp(uni_nll / total_tok), total_tok


def main():
    args = parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    out_dir = Path(args.output)
    data = Path(args.data_dir)
    train_books = read_books(data / "train.txt")
    for extra in args.extra_train:
        train_books += read_books(extra)
    heldout_books = read_books(data / "heldout.txt")
    out_dir.mkdir(parents=True, exist_ok=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.time()
    if args.eval_only:
        tokenizer = AutoTokenizer.from_pretrained(out_dir)
    else:
        tokenizer = train_tokenizer(train_books, args.vocab_size, out_dir)
    train_ids = encode_books(tokenizer, train_books)
    heldout_ids = encode_books(tokenizer, heldout_books)
    print(f"tokenizer: vocab {len(tokenizer)}, bos {tokenizer.bos_token}={tokenizer.bos_token_id}, "
          f"eos {tokenizer.eos_token}={tokenizer.eos_token_id}, pad {tokenizer.pad_token}={tokenizer.pad_token_id}")
    print(f"train tokens {len(train_ids):,} ({len(train_books)} books), "
          f"heldout tokens {len(heldout_ids):,} ({len(heldout_books)} books)", flush=True)

    summary = {}
    if not args.eval_only:
        model = build_model(args, tokenizer).to(args.device)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {n_params:,} parameters", flush=True)
        train_s, tokens_seen = train(args, model, train_ids, tokenizer)
        save_checkpoint(model, out_dir, args.save_dtype)
        summary.update(train_seconds=round(train_s, 1), train_tokens_seen=tokens_seen, device=args.device,
                       steps=args.steps, lr=args.lr, batch_tokens=args.batch_tokens,
                       short_len=args.short_len, seq_len=args.seq_len, long_frac=args.long_frac,
                       autocast_bf16=args.autocast_bf16, save_dtype=args.save_dtype,
                       threads=args.threads, seed=args.seed, passkey_frac=args.passkey_frac,
                       rope_theta=args.rope_theta, extra_train=[Path(x).name for x in args.extra_train])

    # Evaluate exactly what was saved (reloaded from disk, float32 compute).
    model = AutoModelForCausalLM.from_pretrained(out_dir).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    ppl, uni_ppl, n_tok = evaluate(model, heldout_ids.to(args.device), train_ids.to(args.device), len(tokenizer),
                                   args.seq_len)
    summary.update(parameters=n_params, heldout_tokens_scored=n_tok, heldout_ppl=round(ppl, 3),
                   unigram_ppl=round(uni_ppl, 3), eval_window=args.seq_len,
                   total_wall_seconds=round(time.time() - t_start, 1))
    if not args.eval_only:
        (out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"FINAL heldout_ppl={ppl:.3f} unigram_ppl={uni_ppl:.3f} "
          f"(scored tokens={n_tok:,}, window={args.seq_len}, params={n_params:,})", flush=True)


if __name__ == "__main__":
    main()

"""The built-in default data is learnable: a tiny model trained for minutes on a CPU solves
held-out sums it never saw. Slow (minutes): runs only with LAZYTRAIN_SLOW=1."""

import math
import os
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lazytrain.data.dataset import BatchConfig, BatchIterator, encode_prompts, tokenize_samples
from lazytrain.data.synthetic import Tier, make_samples
from lazytrain.data.template import get_template
from lazytrain.data.tokenizer import builtin_tokenizer
from lazytrain.eval.answers import exact_match_report


def train_and_evaluate(*, steps: int, layers: int = 3, hidden: int = 128, batch_size: int = 32,
                       lr: float = 1e-3, tier: str | Tier = "add2", heldout: int = 300,
                       seed: int = 0, device: str = "cpu") -> dict:
    """Train a tiny Llama with plain torch AdamW; greedy exact match on heldout problems."""
    torch.manual_seed(seed)
    tokenizer, template = builtin_tokenizer(), get_template("compact")
    samples = make_samples("train", 50_000, seed=seed, tier=tier)
    train = tokenize_samples(samples, tokenizer, template, max_seq_len=128)
    batches = BatchIterator(dataset=train, config=BatchConfig(batch_size=batch_size, seed=seed))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    start = time.perf_counter()
    for step in range(steps):
        warmup = min(1.0, (step + 1) / 100)
        cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup * cosine
        batch = next(batches)
        loss = model(input_ids=batch.input_ids.to(device), labels=batch.labels.to(device),
                     attention_mask=batch.attention_mask.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    train_seconds = time.perf_counter() - start

    samples = make_samples("heldout", heldout, tier=tier)
    prompts = encode_prompts(samples, tokenizer, template)
    model.eval()
    outputs = []
    with torch.no_grad():
        for i in range(0, len(prompts), 100):
            chunk = prompts[i:i + 100]
            width = max(map(len, chunk))
            pad = tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            generated = model.generate(input_ids=ids, attention_mask=(ids != pad).long(),
                                       max_new_tokens=96, do_sample=False)
            outputs += tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
    golds = [s.response for s in samples]
    report = exact_match_report(outputs, golds)
    wrong = [(s.instruction, out) for s, out, gold in zip(samples, outputs, golds, strict=True)
             if not exact_match_report([out], [gold])["correct"]]
    return {"accuracy": report["accuracy"], "no_answer": report["no_answer"],
            "train_seconds": train_seconds, "final_loss": loss.item(), "wrong": wrong[:5]}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LAZYTRAIN_SLOW") != "1", reason="set LAZYTRAIN_SLOW=1")
def test_default_tier_is_learnable_on_cpu():
    torch.set_num_threads(2)
    result = train_and_evaluate(steps=1000, layers=2)
    assert result["accuracy"] >= 0.9, result

"""Train a small MoE transformer language model end to end with Equinox + optax, on synthetic data.

The twin of examples/train_lm_flax.py (same model, data and options): token + position embeddings -> `--layers`
blocks of [RMSNorm -> causal self-attention -> residual, RMSNorm -> routed MoE FFN (cudnn_moe_jax.nn.EquinoxMoE)
-> residual] -> RMSNorm -> LM head. Equinox layers act on one vector or one sequence, so norms, attention and head
are vmapped over the batch; the MoE layer is not: it routes every token of the batch in one call (its ops have no
vmap rule). Attention, norms and head run in float32, the MoE layer on bf16 tokens and weights. Prints the loss
curve and plots it to a PNG (matplotlib).

    python examples/train_lm_equinox.py                    # CPU: well under a minute
    python examples/train_lm_equinox.py --steps 300 --experts 8 --plot ''
"""

from __future__ import annotations

import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import lm_common
from cudnn_moe_jax import nn


def per_token(layer, x):
    """Apply a layer made for one vector to every token of x (batch, seq, features)."""
    return jax.vmap(jax.vmap(layer))(x)


class Block(eqx.Module):
    """Pre-norm transformer block with a routed MoE feed-forward layer."""

    attn_norm: eqx.nn.RMSNorm
    attn: eqx.nn.MultiheadAttention
    moe_norm: eqx.nn.RMSNorm
    moe: eqx.Module

    def __init__(self, args, key):
        k_attn, k_moe = jax.random.split(key)
        self.attn_norm = eqx.nn.RMSNorm(args.d_model)
        self.attn = eqx.nn.MultiheadAttention(args.heads, args.d_model, key=k_attn)
        self.moe_norm = eqx.nn.RMSNorm(args.d_model)
        self.moe = nn.EquinoxMoE(args.d_model, args.intermediate, args.experts, top_k=args.top_k, act="swiglu",
                                 dtype=jnp.bfloat16, key=k_moe)

    def __call__(self, x):                                    # x (batch, seq, d_model) float32
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        h = per_token(self.attn_norm, x)
        x = x + jax.vmap(lambda seq: self.attn(seq, seq, seq, mask=causal))(h)
        return x + self.moe(per_token(self.moe_norm, x).astype(jnp.bfloat16)).astype(x.dtype)


class MoELanguageModel(eqx.Module):
    tokens: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, args, key):
        k_tok, k_pos, k_head, *k_blocks = jax.random.split(key, 3 + args.layers)
        self.tokens = eqx.nn.Embedding(args.vocab, args.d_model, key=k_tok)
        self.positions = eqx.nn.Embedding(args.seq_len, args.d_model, key=k_pos)
        self.blocks = [Block(args, k) for k in k_blocks]
        self.norm = eqx.nn.RMSNorm(args.d_model)
        self.head = eqx.nn.Linear(args.d_model, args.vocab, use_bias=False, key=k_head)

    def __call__(self, tokens):                               # tokens (batch, seq) int32 -> logits (batch, seq, vocab)
        x = per_token(self.tokens, tokens) + jax.vmap(self.positions)(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return per_token(self.head, per_token(self.norm, x))


def make_train_step(optimizer):
    @eqx.filter_jit
    def train_step(model, opt_state, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return train_step


def main(argv=None) -> int:
    args = lm_common.parse_args(__doc__, "moe_lm_equinox_loss.png", argv)
    sample, floor = lm_common.bigram_data(args)
    model = MoELanguageModel(args, jax.random.PRNGKey(args.seed))
    optimizer = optax.adamw(args.lr)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    train_step = make_train_step(optimizer)
    params = sum(p.size for p in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array)))
    print(f"backend {jax.default_backend()}; {args.layers} blocks, d_model {args.d_model}, {args.experts} experts "
          f"(top-{args.top_k}, I {args.intermediate}) per block; {params} parameters")

    def step(tokens):  # the model and optimizer state are immutable: each step returns new ones
        nonlocal model, opt_state
        model, opt_state, loss = train_step(model, opt_state, tokens)
        return loss

    start = time.perf_counter()
    losses = lm_common.train(step, sample, args, floor)
    print(f"{time.perf_counter() - start:.1f} s (the first step compiles)")
    return lm_common.report(losses, floor, args.plot, "MoE LM (Equinox + cudnn_moe_jax)")


if __name__ == "__main__":
    sys.exit(main())

"""Train a small MoE transformer language model end to end with Flax NNX + optax, on synthetic data.

Model: token + position embeddings -> `--layers` blocks of [RMSNorm -> causal self-attention -> residual,
RMSNorm -> routed MoE FFN (cudnn_moe_jax.nn.FlaxMoE: softmax top-k router, fused SwiGLU expert MLP) -> residual]
-> RMSNorm -> LM head. Attention, norms and head run in float32; the MoE layer takes bf16 tokens and bf16 weights
(its gradients come from the fused backward ops). Data: a random bigram language (examples/lm_common.py); the loss
falls from log(vocab) toward the data's entropy. Prints the loss curve and plots it to a PNG (matplotlib).

    python examples/train_lm_flax.py                       # CPU: well under a minute
    python examples/train_lm_flax.py --steps 300 --experts 8 --plot ''

On a Hopper GPU the MoE layers run on the fused kernels; elsewhere on the pure-jnp reference.
The Equinox twin is examples/train_lm_equinox.py.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import lm_common
from cudnn_moe_jax import nn


class Block(nnx.Module):
    """Pre-norm transformer block with a routed MoE feed-forward layer."""

    def __init__(self, args, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(args.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(args.heads, args.d_model, decode=False, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(args.d_model, rngs=rngs)
        self.moe = nn.FlaxMoE(args.d_model, args.intermediate, args.experts, top_k=args.top_k, act="swiglu",
                              dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):                                    # x (batch, seq, d_model) float32
        causal = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.attn_norm(x), mask=causal)
        # The MoE layer routes every token of the batch in one call (its ops have no vmap rule: never vmap it).
        return x + self.moe(self.moe_norm(x).astype(jnp.bfloat16)).astype(x.dtype)


class MoELanguageModel(nnx.Module):
    def __init__(self, args, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(args.vocab, args.d_model, rngs=rngs)
        self.positions = nnx.Embed(args.seq_len, args.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(args, rngs) for _ in range(args.layers)])
        self.norm = nnx.RMSNorm(args.d_model, rngs=rngs)
        self.head = nnx.Linear(args.d_model, args.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):                               # tokens (batch, seq) int32 -> logits (batch, seq, vocab)
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@nnx.jit
def train_step(model, optimizer, tokens):
    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main(argv=None) -> int:
    args = lm_common.parse_args(__doc__, "moe_lm_flax_loss.png", argv)
    sample, floor = lm_common.bigram_data(args)
    model = MoELanguageModel(args, nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    params = sum(p.size for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    print(f"backend {jax.default_backend()}; {args.layers} blocks, d_model {args.d_model}, {args.experts} experts "
          f"(top-{args.top_k}, I {args.intermediate}) per block; {params} parameters")
    start = time.perf_counter()
    losses = lm_common.train(lambda tokens: train_step(model, optimizer, tokens), sample, args, floor)
    print(f"{time.perf_counter() - start:.1f} s (the first step compiles)")
    return lm_common.report(losses, floor, args.plot, "MoE LM (Flax NNX + cudnn_moe_jax)")


if __name__ == "__main__":
    sys.exit(main())

"""What the two language-model training examples share (train_lm_flax.py, train_lm_equinox.py): their options, the
synthetic data, and the loss report (printed, and plotted when matplotlib is installed).

The data is a random bigram "language" over `--vocab` tokens: after token t comes successor[t] (a fixed random
permutation) with probability `--predictability`, else a uniformly random token. A model that has learned the
successor table predicts the next token as well as anything can: its loss is the entropy of the next token (the
"floor" printed beside the loss), well below log(vocab) for a model that knows nothing.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp


def parse_args(description: str, default_plot: str, argv=None):
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    parser.add_argument("--predictability", type=float, default=0.9,
                        help="probability that a token is its predecessor's fixed successor (default 0.9)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--d-model", type=int, default=64, help="model width H, a multiple of 8 (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer (default 4)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--intermediate", type=int, default=64, help="expert width I, a multiple of 32 (default 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (default 10)")
    parser.add_argument("--plot", default=default_plot,
                        help=f"PNG file for the loss curve (default {default_plot}; '' for none; needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def bigram_data(args):
    """(sample, floor): sample(key) -> (batch, seq_len + 1) int32 tokens (inputs = [:, :-1], targets = [:, 1:]);
    floor = the entropy of the next token in nats, the lowest loss any model can reach."""
    vocab, p = args.vocab, args.predictability
    successor = jax.random.permutation(jax.random.PRNGKey(args.seed + 1), vocab)

    @jax.jit
    def sample(key):
        k_first, k_keep, k_noise = jax.random.split(key, 3)
        first = jax.random.randint(k_first, (args.batch,), 0, vocab)
        keep = jax.random.bernoulli(k_keep, p, (args.seq_len, args.batch))
        noise = jax.random.randint(k_noise, (args.seq_len, args.batch), 0, vocab)

        def next_token(token, keep_and_noise):
            keep_t, noise_t = keep_and_noise
            token = jnp.where(keep_t, successor[token], noise_t)
            return token, token

        _, rest = jax.lax.scan(next_token, first, (keep, noise))
        return jnp.concatenate([first[:, None], rest.T], axis=1).astype(jnp.int32)

    hit, miss = p + (1 - p) / vocab, (1 - p) / vocab
    floor = -hit * math.log(hit) - (vocab - 1) * miss * math.log(miss) if miss > 0 else 0.0
    return sample, floor


def train(train_step, sample, args, floor) -> list[float]:
    """Run `train_step(tokens) -> loss` for args.steps steps on fresh batches; print the loss as it goes."""
    print(f"training {args.steps} steps: batch {args.batch} x {args.seq_len} tokens, vocab {args.vocab}; "
          f"a uniform guess scores log(vocab) = {math.log(args.vocab):.3f}, the data's floor is {floor:.3f}")
    key, losses = jax.random.PRNGKey(args.seed + 2), []
    for step in range(args.steps):
        key, batch_key = jax.random.split(key)
        losses.append(float(train_step(sample(batch_key))))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def report(losses, floor, plot_path: str, title: str) -> int:
    """Print the summary, plot the curve to `plot_path` (if given and matplotlib imports); 1 if the loss is not
    finite, else 0."""
    tail = losses[-min(10, len(losses)):]
    print(f"loss {losses[0]:.4f} -> {sum(tail) / len(tail):.4f} (mean of the last {len(tail)} steps); "
          f"floor {floor:.4f}")
    if not all(math.isfinite(v) for v in losses):
        print("non-finite loss")
        return 1
    if plot_path:
        try:
            import matplotlib
            matplotlib.use("Agg")  # draw to a file; no display needed
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)")
            return 0
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(losses, label="training loss")
        ax.axhline(floor, linestyle="--", color="gray", label="floor: entropy of the next token")
        ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path, dpi=120)
        plt.close(fig)
        print(f"loss curve plotted to {plot_path}")
    return 0

"""The ``jquant`` command: ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _mlp_params(key, dims):
    """A random Flax linen MLP (Dense layers without the flax import cost at CLI start)."""
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, d in enumerate(dims[1:]):
                x = nn.Dense(d, name=f"dense_{i}")(x)
                if i < len(dims) - 2:
                    x = nn.gelu(x)
            return x

    model = MLP()
    x = jax.random.normal(key, (8, dims[0]), jnp.float32)
    return model, model.init(key, x)["params"]


def demo(argv=None) -> int:
    """Quantizes a random Flax MLP with every registered scheme and prints one row per scheme."""
    import jquant
    from jquant.registry import get_scheme

    parser = argparse.ArgumentParser(prog="jquant demo", description=demo.__doc__)
    parser.add_argument("--dims", default="512,2048,512", help="layer widths, comma separated")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    key = jax.random.key(0)
    model, params = _mlp_params(key, dims)
    x = jax.random.normal(jax.random.key(1), (args.tokens, dims[0]), jnp.bfloat16)
    ref = model.apply({"params": params}, x.astype(jnp.float32))
    n_layers = len(dims) - 1

    def forward(scheme, weights, biases, x):
        for i, (w, b) in enumerate(zip(weights, biases)):
            x = scheme.apply(x, w, b.astype(x.dtype))
            if i < n_layers - 1:
                x = jax.nn.gelu(x)
        return x

    print(f"jquant demo: MLP {dims}, {args.tokens} tokens, bf16 activations, device {jax.devices()[0].device_kind}")
    header = f"{'scheme':<26}{'bits/w':>8}{'weight KiB':>12}{'rel err':>10}{'µs/call':>10}  description"
    print(header)
    print("-" * len(header))
    float_bytes = sum(int(np.prod(params[f"dense_{i}"]["kernel"].shape)) * 2 for i in range(n_layers))
    print(f"{'bf16 (unquantized)':<26}{16.0:>8.2f}{float_bytes / 1024:>12.1f}{0.0:>10.4f}{'':>10}")
    for name in jquant.schemes():
        scheme = get_scheme(name)
        try:
            qws = [scheme.quantize_kernel(params[f"dense_{i}"]["kernel"]) for i in range(n_layers)]
            prepared = [scheme.process_weights_after_loading(q) for q in qws]
            biases = [params[f"dense_{i}"]["bias"] for i in range(n_layers)]
            fn = jax.jit(lambda w, b, x, s=scheme: forward(s, w, b, x))
            y = fn(prepared, biases, x).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(10):
                y = fn(prepared, biases, x)
            y.block_until_ready()
            us = (time.perf_counter() - t0) / 10 * 1e6
            err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            nbytes = sum(q.nbytes for q in qws)
            bits = 8 * nbytes / sum(q.size for q in qws)
            print(f"{name:<26}{bits:>8.2f}{nbytes / 1024:>12.1f}{err:>10.4f}{us:>10.0f}  {scheme.description}")
        except Exception as e:  # one scheme failing should not hide the others' rows
            print(f"{name:<26}  failed: {type(e).__name__}: {e}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo, "bench": _bench}
    if not argv or argv[0] not in commands:
        print("usage: jquant {demo|bench} [options]   (jquant COMMAND --help for each)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:]) or 0


def _bench(argv) -> int:
    from jquant.bench import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())

"""An observable protoserve in this process: tiny random model, server, gateway, in-memory span exporter.

The engine tests' tiny Llama (random weights, byte-level tokenizer) is written
again here with a chat template, so chat requests work too. Everything runs on
one background event loop, the way ``protoserve serve`` runs the server and the
gateway together: they share the tracer provider (an SDK provider with an
in-memory exporter, never installed globally, so other tests are unaffected)
and the server's Prometheus registry.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

TINY_VOCAB = 320  # 256 byte tokens + <|endoftext|>; ids above have no text
TINY_EOS = 256
MODEL_NAME = "tiny-obs"
API_KEYS = ("obs-key-alpha", "obs-key-beta")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def write_tiny_model(directory: Path) -> Path:
    """A 2-layer random Llama with a one-token-per-byte tokenizer and a chat template.

    Weights are written with safetensors directly (Hugging Face names), which
    spares the tests importing transformers.
    """
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from protoserve.engine.tokenizer.tokenizer import byte_level_alphabet

    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "eos_token_id": TINY_EOS,
        "tie_word_embeddings": False,
    }
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        # Large weights give peaked next-token distributions, so greedy output is stable.
        return torch.randn(*shape, generator=generator) * 0.2

    weights = {"model.embed_tokens.weight": randn(TINY_VOCAB, hidden), "lm_head.weight": randn(TINY_VOCAB, hidden),
               "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": randn(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": randn(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": randn(inter, hidden),
            p + "mlp.up_proj.weight": randn(inter, hidden),
            p + "mlp.down_proj.weight": randn(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    alphabet = sorted(byte_level_alphabet().items(), key=lambda kv: kv[1])
    tok = Tokenizer(models.BPE(vocab=dict(alphabet), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE})
    )
    return directory


@dataclass
class ObsStack:
    """Server + gateway + engine on a private loop; spans land in ``exporter``."""

    model_dir: Path
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    engine: Any = None
    app: Any = None  # ServerApp, auth on (API_KEYS)
    gateway: Any = None  # GatewayServer in front of it
    extra_apps: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.provider = TracerProvider()
        # Synchronous export: a span is in the exporter the moment it ends.
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self._thread = threading.Thread(target=self.loop.run_forever, name="obs-stack", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def grpc_target(self) -> str:
        return self.app.grpc_target

    @property
    def http_url(self) -> str:
        return self.gateway.url

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    async def _start(self) -> None:
        from protoserve.engine.async_engine import AsyncEngine
        from protoserve.engine.config import EngineConfig
        from protoserve.gateway.app import GatewayServer

        self.engine = await asyncio.to_thread(
            AsyncEngine.from_pretrained,
            str(self.model_dir),
            config=EngineConfig(max_kv_blocks=256, max_num_seqs=8),
            progress=False,
            model_name=MODEL_NAME,
        )
        self.engine.start()
        self.app = await self.start_app()
        self.gateway = GatewayServer(
            "127.0.0.1",
            0,
            self.app.grpc_target,
            metrics_registry=self.app.metrics.registry,
            tracer_provider=self.provider,
        )
        await self.gateway.start()

    async def start_app(self, **config: Any) -> Any:
        """Another ServerApp (auth on, traced) on the same engine; ``config`` overrides ServerConfig fields."""
        from protoserve.server.app import ServerApp, ServerConfig
        from protoserve.server.models.served_model import ModelCard
        from protoserve.server.security.auth import Authenticator

        server_config = ServerConfig(port=0, http_port=None, grace_period_s=1.0, **config)
        app = ServerApp(server_config, auth=Authenticator(API_KEYS), tracer_provider=self.provider)
        await app.start()
        await app.attach_engine(self.engine, ModelCard("float32", "none", str(self.model_dir)))
        if self.app is not None:
            self.extra_apps.append(app)
        return app

    async def _stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        for app in [*self.extra_apps, self.app]:
            if app is not None:
                await app.stop()
        if self.engine is not None:
            await self.engine.shutdown()

    def start(self) -> ObsStack:
        self.run(self._start())
        return self

    def stop(self) -> None:
        try:
            self.run(self._stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.provider.shutdown()


def auth_headers(key: str = API_KEYS[0], user_id: str | None = None, **extra: str) -> dict[str, str]:
    """HTTP headers with a bearer key and an optional user id."""
    headers = {"authorization": f"Bearer {key}", **extra}
    if user_id is not None:
        headers["x-user-id"] = user_id
    return headers


def grpc_metadata(key: str = API_KEYS[0], user_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """The same as gRPC call metadata."""
    return tuple(auth_headers(key, user_id).items())


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Prometheus text → {(sample name, labels): value}, via prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series does not exist yet (counters start there)."""
    return samples.get((name, frozenset(labels.items())), 0.0)

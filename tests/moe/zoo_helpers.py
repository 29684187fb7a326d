"""The transformers zoo as a test corpus (tests/moe/test_zoo_*.py).

* :func:`experts_classes`: every experts class of the installed transformers
  that the experts-implementation mechanism can dispatch, found by scanning
  ``transformers.models.*.modeling_*`` (the modules that use
  ``@use_experts_implementation``) for classes whose ``forward`` is the
  decorator's;
* :func:`tiny_experts`: one of them built tiny from its own config class
  (defaults, sizes shrunk), weights drawn from a seeded normal;
* :func:`causal_lm_families` / :func:`tiny_model`: every MoE family's
  ``*ForCausalLM``, built tiny (:func:`tiny_config`: sizes shrunk, every
  dropout and jitter on, :data:`FAMILY_OVERRIDES` where a family needs more);
* :func:`assert_same` / :func:`assert_same_grads`: bit equality, with the
  largest difference in the message.

Everything is built from configs with random weights: nothing is downloaded.
``MOE_AUTOGRAD_ZOO=all`` runs every case (``make zoo``); by default a subset
covering every loop variant and routing family runs.

New releases: :data:`KNOWN_FAMILIES` and :data:`KNOWN_EXPERTS` list what
transformers :data:`ZOO_TRANSFORMERS` (the ``test`` extra's upper bound) has.
A family or class of a newer release that is in neither and that the tiny
builder cannot make, or whose experts moe_autograd refuses by name, is
skipped with the reason (:func:`skip_if_new`); a listed one that fails still
fails. ``make latest`` reports each new one as a row (tools/zoo_report.py).
Not a test module (no ``test_`` prefix).
"""
import copy
import functools
import importlib
import inspect
import os
import pkgutil
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra: "
                                   "pip install -e '.[examples]' (make test installs it)")
from transformers import PreTrainedConfig  # noqa: E402

from moe_autograd.moe.hf_experts import can_dispatch  # noqa: E402

ZOO_ALL = os.environ.get("MOE_AUTOGRAD_ZOO", "") == "all"

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 16, 16, 8

#: The transformers release the lists below were taken from (setup.cfg's
#: ``test`` extra allows up to it).
ZOO_TRANSFORMERS = "5.25.0"

#: Every MoE family (package) of transformers :data:`ZOO_TRANSFORMERS` that
#: :func:`causal_lm_families` finds.
KNOWN_FAMILIES = frozenset({
    "afmoe", "aria", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "doge", "dots1", "dots3_note",
    "ergo", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling",
    "inkling2", "inkling2_loop", "jamba", "jetmoe", "kimi_linear", "kolibri1", "kolibri1_1",
    "laguna", "lara_mini", "lfm2_moe", "llama4", "longcat_flash", "mellum", "mimo_v2_flash",
    "minicpm5_moe", "minimax", "minimax_m2", "minimax_m3_vl", "mistral4", "mixtral",
    "nemotron_h", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
    "qwen4_exp", "solar_open", "zaya",
})

#: Every dispatchable experts class of transformers :data:`ZOO_TRANSFORMERS`
#: (:func:`experts_classes`), by name.
KNOWN_EXPERTS = frozenset({
    "AXK1Experts", "AXK2Experts", "AfmoeExperts", "AriaExperts", "BailingHybridExperts",
    "BeamExperts", "Cohere2MoeExperts", "DeepseekOcr2TextExperts", "DeepseekV2Experts",
    "DeepseekV32Experts", "DeepseekV3Experts", "DeepseekV4Experts", "DiffusionGemmaTextExperts",
    "Dots1Experts", "Dots3NoteExperts", "ErgoExpertProjections", "Ernie4_5_MoeExperts",
    "Ernie4_5_VLMoeMoeExperts", "ExaoneMoeExperts", "FlexOlmoExperts", "FlintExperts",
    "Gemma4TextExperts", "Glm4MoeExperts", "Glm4MoeLiteExperts", "Glm4vMoeTextExperts",
    "Glm5NextTextExperts", "GlmMoeDsaExperts", "GptOssExperts", "GraniteMoeExperts",
    "GraniteMoeHybridExperts", "GraniteMoeSWAExperts", "GraniteMoeSharedExperts", "HYV3Experts",
    "HYV4Experts", "HYV4VLExperts", "HunYuanMoEV1Experts", "Inkling2Experts",
    "Inkling2LoopExperts", "InklingExperts", "JambaExperts", "KimiLinearExperts",
    "Kolibri1Experts", "Kolibri1_1Experts", "LagunaExperts", "LaraMiniExperts",
    "Lfm2MoeExperts", "LongcatFlashExperts", "MellumExperts", "MiMoV2FlashExperts",
    "MiniCPM5MoeExperts", "MiniMaxExperts", "MiniMaxM2Experts", "MiniMaxM3VLExperts",
    "Mistral4Experts", "MistralLarge4TextExperts", "MixtralExperts", "MuseSparkExperts",
    "NemotronHExperts", "OlmoeExperts", "OpenAIPrivacyFilterExperts", "PhimoeExperts",
    "Qwen2MoeExperts", "Qwen3MoeExperts", "Qwen3NextExperts", "Qwen3OmniMoeTalkerTextExperts",
    "Qwen3OmniMoeThinkerTextExperts", "Qwen3VLMoeTextExperts", "Qwen3_5MoeExperts",
    "Qwen4ExpTextExperts", "SolarOpenExperts", "Step3p7Experts", "UnlimitedOcrTextExperts",
    "ZayaExperts",
})

#: How a skip of a new family or class starts (tools/zoo_report.py reads it).
NEW_PREFIX = "new in transformers"


def is_new(name: str) -> bool:
    """Whether ``name`` (a family's package or an experts class's name) is
    in neither known list: it came with a release after ZOO_TRANSFORMERS."""
    return name not in KNOWN_FAMILIES and name not in KNOWN_EXPERTS


def skip_if_new(name: str, what: str, error: BaseException) -> None:
    """Skips the test (``what``: what could not be done, and ``error``) when
    ``name`` is new; returns otherwise, so that the caller re-raises: a
    family or class the zoo supported that now behaves differently fails."""
    if is_new(name):
        pytest.skip(f"{NEW_PREFIX} {transformers.__version__} (the zoo knows "
                    f"{ZOO_TRANSFORMERS}): {name}: {what}: {type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}")

# Config attributes shrunk for a tiny experts module (those experts __init__ read).
_SIZES: Dict[str, int] = {
    "hidden_size": HIDDEN, "moe_hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE, "moe_intermediate_size": INTERMEDIATE,
    "num_local_experts": NUM_EXPERTS, "num_experts": NUM_EXPERTS,
    "n_routed_experts": NUM_EXPERTS, "moe_num_experts": NUM_EXPERTS,
}


def _models_package_dirs() -> List[str]:
    import transformers.models as models
    return sorted(name for _, name, is_pkg in pkgutil.iter_modules(models.__path__) if is_pkg)


@functools.lru_cache(maxsize=None)
def experts_classes() -> Tuple[type, ...]:
    """Every dispatchable experts class of the installed transformers, by
    module then name."""
    import transformers.models as models
    found: List[type] = []
    for package in _models_package_dirs():
        directory = os.path.join(models.__path__[0], package)
        for file in sorted(os.listdir(directory)):
            if not (file.startswith("modeling_") and file.endswith(".py")):
                continue
            with open(os.path.join(directory, file), encoding="utf-8") as f:
                if "use_experts_implementation" not in f.read():
                    continue
            module = importlib.import_module(f"transformers.models.{package}.{file[:-3]}")
            for obj in vars(module).values():
                if isinstance(obj, type) and obj.__module__ == module.__name__ \
                        and issubclass(obj, nn.Module) and can_dispatch(obj):
                    found.append(obj)
    return tuple(found)


def _config_classes(module_name: str) -> List[type]:
    """The config classes of the package of ``module_name`` (its
    ``configuration_*`` modules), text configs first."""
    package = module_name.rsplit(".", 1)[0]
    classes: List[type] = []
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if info.name.startswith("configuration_"):
            module = importlib.import_module(f"{package}.{info.name}")
            classes += [obj for obj in vars(module).values()
                        if isinstance(obj, type) and obj.__module__ == module.__name__
                        and issubclass(obj, PreTrainedConfig)]
    return sorted(classes, key=lambda c: ("Text" not in c.__name__, c.__name__))


def _shrink(config: Any, sizes: Dict[str, int]) -> None:
    for attr, size in sizes.items():
        if not hasattr(config, attr):
            continue
        value = getattr(config, attr)
        if value is None or isinstance(value, int) and not isinstance(value, bool):
            setattr(config, attr, size)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            setattr(config, attr, type(value)(size for _ in value))


def init_weights(module: nn.Module, seed: int, std: float = 0.3) -> None:
    """Every parameter from a seeded normal (transformers' experts are
    created with ``torch.empty``)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * std)


@functools.lru_cache(maxsize=None)
def experts_config(experts_class: type) -> Any:
    """A tiny config ``experts_class`` builds from: the first config class of
    its package that builds it with the sizes shrunk."""
    errors = []
    for config_class in _config_classes(experts_class.__module__):
        try:
            config = config_class()
            _shrink(config, _SIZES)
            module = _build(experts_class, config)
        except Exception as error:  # noqa: BLE001 - try the next config class
            errors.append(f"{config_class.__name__}: {type(error).__name__}: {error}")
            continue
        if sum(p.numel() for p in module.parameters()) < 100_000:
            return config
        errors.append(f"{config_class.__name__}: not tiny")
    error = RuntimeError(f"no config builds a tiny {experts_class.__name__}: {errors}")
    skip_if_new(experts_class.__name__, "the tiny builder cannot make it", error)
    raise error


def _build(experts_class: type, config: Any) -> nn.Module:
    """``experts_class(config)``, with the tiny intermediate size for the
    classes that take it as an argument (their blocks pass it)."""
    init = getattr(experts_class.__init__, "__wrapped__", experts_class.__init__)
    parameters = inspect.signature(init).parameters
    kwargs: Dict[str, Any] = {}
    if "intermediate_size" in parameters:
        kwargs["intermediate_size"] = INTERMEDIATE
    if "layer_idx" in parameters:  # per-layer settings (Bailing, Step3p7: 5.25's swiglu_limits)
        kwargs["layer_idx"] = 0
    return experts_class(config, **kwargs)


def tiny_experts(experts_class: type, implementation: str, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny ``experts_class`` running ``implementation``, seeded weights."""
    config = copy.deepcopy(experts_config(experts_class))
    config._experts_implementation = implementation
    module = _build(experts_class, config)
    init_weights(module, seed)
    return module.to(dtype)


def assert_same(ours: Any, stock: Any, what: str) -> None:
    """``torch.equal`` (same dtype, same bits up to the sign of zero), with
    the largest difference in the message."""
    assert isinstance(ours, Tensor) and isinstance(stock, Tensor), what
    assert ours.dtype == stock.dtype and ours.shape == stock.shape, \
        f"{what}: {ours.dtype}{list(ours.shape)} vs {stock.dtype}{list(stock.shape)}"
    if not torch.equal(ours, stock):
        diff = (ours.double() - stock.double()).abs()
        raise AssertionError(f"{what} differs from stock: max |diff| {diff.max().item():.3g} "
                             f"at {diff.argmax().item()} ({int((diff > 0).sum())} of "
                             f"{diff.numel()} elements)")


def grads(named: Iterable[Tuple[str, Tensor]]) -> Dict[str, Optional[Tensor]]:
    """A copy of every ``.grad`` of ``named`` (None where there is none)."""
    return {name: (None if p.grad is None else p.grad.clone()) for name, p in named}


def assert_same_grads(ours: Dict[str, Optional[Tensor]], stock: Dict[str, Optional[Tensor]],
                      what: str) -> None:
    assert ours.keys() == stock.keys(), what
    for name, g in stock.items():
        if g is None:
            assert ours[name] is None, f"{what}: {name} has a gradient, stock none"
        else:
            assert_same(ours[name], g, f"{what}: gradient of {name}")




# --- tiny models ------------------------------------------------------------

# Integer config attributes shrunk for a tiny model (first matching rule).
_TINY_RULES: List[Tuple[str, int]] = [
    (r"^vocab_size$", 96),
    (r"^(num_hidden_layers|n_layers|num_layers)$", 2),
    (r"^(num_experts_per_tok|moe_top_k|moe_topk|top_k|num_experts_per_token)$", 2),
    (r"^(num_local_experts|num_experts|n_routed_experts|moe_num_experts|num_routed_experts|"
     r"ffn_config_moe_num_experts)$", 8),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", 1),
    (r"^(n_group|num_expert_group)$", 2),
    (r"^(topk_group|topk_group_num)$", 1),
    (r"^(first_k_dense_replace|num_dense_layers|first_k_dense)$", 0),
    (r"^(decoder_sparse_step|moe_layer_freq|expert_layer_period|interleave_moe_layer_step)$", 1),
    (r"^(expert_layer_offset|moe_layer_start_index)$", 0),
    (r"(^|_)(hidden_size|d_model|hidden_dim|n_embd)$", 32),
    (r"intermediate_size|ffn_hidden_size|ffn_dim", 32),
    (r"^(num_attention_heads|n_heads|num_heads|n_head)$", 2),
    (r"key_value_heads|^num_kv_heads$", 2),
    (r"(^|_)head_dim$|^kv_channels$", 16),
    (r"lora_rank$", 16),
    (r"max_position_embeddings|max_seq_len|^n_positions$", 64),
    (r"sliding_window$|attention_chunk_size$|^window_size$", 8),
    (r"^mamba_n_heads$", 4),
    (r"^mamba_d_head$", 16),
    (r"d_state$", 8),
    (r"^mamba_dt_rank$|^time_step_rank$", 4),
    (r"chunk_size$", 16),
    (r"^linear_num_(key|value)_heads$", 2),
    (r"^linear_(key|value)_head_dim$", 8),
]


# Sizes some configs leave None by default (derived, or MoE off): set them too.
_UNSET_SIZES = (r"^head_dim$|experts|^num_experts_per_tok$|intermediate_size")


def tiny_config(config_class: type, **overrides: Any) -> Any:
    """``config_class`` with its sizes shrunk (:data:`_TINY_RULES` on the
    integer attributes of its defaults), every dropout and jitter > 0,
    ``output_router_logits`` on, the eager experts and attention, then
    ``overrides``."""
    defaults = config_class().to_dict()
    values: Dict[str, Any] = {}
    for key, value in defaults.items():
        if key.startswith("_") or isinstance(value, bool):
            continue
        if isinstance(value, int) or value is None:
            for pattern, size in _TINY_RULES:
                if re.search(pattern, key):
                    if isinstance(value, int) or re.search(_UNSET_SIZES, key):
                        values[key] = size
                    break
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key) and value == 0.0:
            values[key] = 0.1
        if isinstance(value, float) and "jitter" in key and value == 0.0:
            values[key] = 0.01
    if "qk_nope_head_dim" in defaults and "qk_head_dim" in defaults:
        # multi-head latent attention: q/k heads are nope + rope wide
        values["qk_head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    if "output_router_logits" in defaults:
        values["output_router_logits"] = True
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(defaults.get(token), int):
            values[token] = min(defaults[token], 3)
    values.update(overrides)
    config = config_class(**values)
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    return config


# Config values a family needs on top of the generic shrinking (MoE switched
# on where it is off by default, every layer sparse, constraints of the config).
FAMILY_OVERRIDES: Dict[str, Dict[str, Any]] = {
    "beam": dict(mlp_layer_types=["sparse", "sparse"]),
    "dbrx": dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=96,
                 resid_pdrop=0.1, emb_pdrop=0.1,
                 attn_config=dict(kv_n_heads=2, attn_pdrop=0.1, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2,
                                 moe_jitter_eps=0.01)),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"]),
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=2),
    "flint": dict(mlp_only_layers=[]),
    "gemma4": dict(enable_moe_block=True, num_experts=8, top_k_experts=2,
                   moe_intermediate_size=16, vocab_size_per_layer_input=96,
                   hidden_size_per_layer_input=8),
    # index heads: at most the query heads of one key head; layers 0 and 1 dense by default
    "kolibri1_1": dict(index_num_heads=1, mlp_only_layers=[]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "mimo_v2_flash": dict(num_key_value_heads=1),  # doubled on sliding layers
    "mistral4": dict(head_dim=32),
    "zaya": dict(num_experts_per_tok=1),
}


@functools.lru_cache(maxsize=None)
def causal_lm_families() -> Tuple[Tuple[str, type], ...]:
    """``(package, *ForCausalLM class)`` of every MoE family of the installed
    transformers: the packages whose modeling defines a dispatchable experts
    class or a class named ``*Experts`` / ``*SparseMoe*`` / ``*MoE*``."""
    import transformers.models as models
    found: List[Tuple[str, type]] = []
    dispatchable = {cls.__module__ for cls in experts_classes()}
    for package in _models_package_dirs():
        name = f"transformers.models.{package}.modeling_{package}"
        path = os.path.join(models.__path__[0], package, f"modeling_{package}.py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        if name not in dispatchable and not re.search(
                r"^class \w*(Experts|SparseMoe|MoE|Moe)\w*\(", source, re.MULTILINE):
            continue
        module = importlib.import_module(name)
        for cls_name in re.findall(r"^class (\w+ForCausalLM)\(", source, re.MULTILINE):
            found.append((package, getattr(module, cls_name)))
    return tuple(found)


def tiny_model(package: str, lm_class: type, seed: int = 0) -> nn.Module:
    """A tiny ``lm_class`` (random weights, seed ``seed``) in train mode;
    skips a new family (:func:`skip_if_new`) that cannot be built tiny."""
    try:
        config = tiny_config(lm_class.config_class, **FAMILY_OVERRIDES.get(package, {}))
        torch.manual_seed(seed)
        return lm_class(config).train()
    except Exception as error:  # noqa: BLE001 - a new family is skipped, a known one fails
        skip_if_new(package, "the tiny builder cannot make it", error)
        raise

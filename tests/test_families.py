"""Model families in the analysis: exact parameter counts (published ones for the real presets),
the estimator's parameters and activations against the live ledgers for the llama family, FLOPs,
the family flags on the command line, `train --init-from-hf` / `--resume` of an import, and the
qwen2 (q/k/v biases) and qwen3 (q/k norms, explicit head width) families under tp=2."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mini3d.cli import main
from mini3d.config import PRESETS, ModelConfig, Plan
from mini3d.cost.flops import flops_per_token
from mini3d.cost.memory import estimate_memory
from mini3d.cost.params import stage_param_count
from mini3d.launch.launcher import launch
from mini3d.models.transformer import GPT
from mini3d.pp.partition import build_stages
from mini3d.run.train import make_spec, train_worker

LLAMA = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, max_seq_len=128, d_ff=96,
                    family="llama", n_kv_heads=2, tie_embeddings=True)
PUBLISHED = {"gpt2-124m": 124_439_808, "gpt2-355m": 354_823_168, "gpt2-774m": 774_030_080,
             "gpt2-1.5b": 1_557_611_200, "llama-3.2-1b": 1_235_814_400,
             "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
             "llama-3.1-405b": 405_853_388_800}


def test_presets_have_the_published_parameter_counts_and_aliases():
    for name, n in PUBLISHED.items():
        assert PRESETS[name].n_params() == n, name
    assert PRESETS["gpt2-small"] is PRESETS["gpt2-124m"] and PRESETS["gpt2-xl"] is PRESETS["gpt2-1.5b"]
    assert PRESETS["gpt-70b"].family == "gpt2"  # the course's GPT-style teaching shape stays


QWEN2 = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=256, max_seq_len=32, d_ff=48,
                    family="qwen2", n_kv_heads=2, rope_base=1e6)
QWEN3 = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=256, max_seq_len=32, d_ff=48,
                    family="qwen3", n_kv_heads=2, rope_base=1e6, explicit_head_dim=12)  # q: 48 wide
# the model cards' totals and non-embedding counts (Qwen2.5-7B: 7.61B / 6.53B; Qwen3-8B: 8.2B /
# 6.95B, both untied), given to three significant figures: 0.5% covers that rounding
QWEN_PUBLISHED = {"qwen2.5-7b": (7.61e9, 6.53e9), "qwen3-8b": (8.2e9, 6.95e9)}


def test_qwen_presets_have_their_published_shapes_and_counts():
    for name, (total, body) in QWEN_PUBLISHED.items():
        cfg = PRESETS[name]
        embeddings = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
        assert abs(cfg.n_params() / total - 1) < 0.005, (name, cfg.n_params())
        assert abs((cfg.n_params() - embeddings) / body - 1) < 0.005, (name, cfg.n_params())
    q3, q2 = PRESETS["qwen3-8b"], PRESETS["qwen2.5-7b"]
    assert (q3.qk_norm, q3.qkv_bias, q3.head_dim, q3.q_dim, q3.kv_dim) == (True, False, 128, 4096, 1024)
    assert (q2.qk_norm, q2.qkv_bias, q2.head_dim, q2.kv_dim) == (False, True, 128, 512)
    assert PRESETS["qwen3-8b"].n_params() == 8_190_735_360  # exact: 36 x 192,946,432 + 2 x V x h + h
    assert not q3.problems() and not q2.problems()


@pytest.mark.parametrize("cfg", [QWEN2, QWEN3, dataclasses.replace(QWEN3, tie_embeddings=True),
                                 dataclasses.replace(QWEN2, family="llama", qk_norm=True,
                                                     explicit_head_dim=6)],
                         ids=["qwen2", "qwen3-head-dim-12", "qwen3-tied", "llama-bias-qk-norm-head-dim-6"])
def test_qwen_param_counts_equal_the_modules(cfg):
    assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.n_params()
    for stage in (0, 1):
        module = build_stages(cfg, 0, stage, 2)[stage]
        assert stage_param_count(cfg, Plan(pp=2, micro_batches=2), stage) == \
            sum(p.numel() for p in module.parameters())


QWEN_TP2_CASES = [("tp2", dict(tp=2, micro_batches=2)),
                  ("tp2-sp", dict(tp=2, micro_batches=2, sequence_parallel=True))]


def _qwen_cases():
    from tests.test_3d import F64_BASE

    return [(n, Plan(**kw, **F64_BASE)) for n, kw in QWEN_TP2_CASES]


@pytest.fixture(scope="module")
def qwen_tp2_runs():
    """[every rank's results] of QWEN2, QWEN3: both models' layouts in one 2-rank launch (one launch
    each cost a second process start-up for the same world)."""
    from tests.test_3d import SEED, STEPS
    from tests.threed_workers import run_layouts_of

    cases = [{"name": n, "plan": dataclasses.asdict(p)} for n, p in _qwen_cases()]
    per_cfg = launch(run_layouts_of, 2, [(cases, dataclasses.asdict(c)) for c in (QWEN2, QWEN3)], STEPS, SEED,
                     device="cpu", timeout=200)
    return [[rank[k] for rank in per_cfg] for k in range(2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
def test_qwen_families_under_tp2_equal_the_reference(cfg, qwen_tp2_runs):
    """tp=2, with and without sequence parallelism, in float64 against the one-process model:
    qwen2's q/k/v biases split with their heads' rows; qwen3's per-head norm weights are
    replicated while each rank normalises only its heads, so their gradients are summed over tp
    (by `f` on the weight, or under sequence parallelism by the replicated-gradient sum). Bounds:
    test_3d's F64 (summation order only), explained there."""
    from tests.test_3d import F64, STEPS, check_float32, reference

    cases, results = _qwen_cases(), qwen_tp2_runs[[QWEN2, QWEN3].index(cfg)]
    ref = reference(STEPS, cfg=cfg, dtype=torch.float64)
    norm_grads = [n for n in ref[1][0] if "_norm" in n or "qkv.bias" in n]
    assert len(norm_grads) == (2 if cfg.qk_norm else 1) * cfg.n_layers and all(ref[1][0][n].abs().max() > 0 for n in norm_grads)
    for name, plan in cases:
        for r in (r for per_rank in results for r in per_rank if r["name"] == name):
            assert r["losses"] == pytest.approx(ref[0], abs=F64["loss"]), name
        check_float32(name, plan, results, ref, cfg=cfg, bounds=F64)


@pytest.mark.parametrize("cfg", [LLAMA, dataclasses.replace(LLAMA, tie_embeddings=False, n_kv_heads=1),
                                 PRESETS["tiny"], dataclasses.replace(PRESETS["tiny"], tie_embeddings=True,
                                                                      activation="gelu_tanh")],
                         ids=["llama-tied-gqa", "llama-untied-mqa", "gpt2-untied", "gpt2-tied"])
def test_param_counts_equal_the_modules(cfg):
    assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.n_params()
    for plan in (Plan(pp=2, micro_batches=2), Plan(tp=2)):  # a tied head's copy on the last stage
        for stage, module in build_stages(cfg, 0, 0, plan.pp).items() if plan.pp == 1 else \
                [(r, m) for r in range(2) for m in build_stages(cfg, 0, r, 2).values()]:
            if plan.tp == 1:
                assert stage_param_count(cfg, plan, stage) == sum(p.numel() for p in module.parameters())


def test_flops_count_gqa_and_swiglu():
    cfg, h, f, kv = LLAMA, LLAMA.d_model, LLAMA.d_ff, LLAMA.kv_dim
    assert flops_per_token(cfg, 128)["layer"] == 2 * (h * (h + 2 * kv) + h * h + 3 * h * f) + 4 * 128 * h
    gpt = ModelConfig(d_model=h, n_heads=4, d_ff=f)
    assert flops_per_token(gpt, 128)["layer"] == 2 * (4 * h * h + 2 * h * f) + 4 * 128 * h


@pytest.mark.timeout(120)
def test_llama_model_states_equal_the_live_ledger():
    plan = Plan(tp=2, pp=2, global_batch=8, micro_batches=2, seq_len=64)  # tied head across stages
    out = launch(train_worker, 4, make_spec(LLAMA, plan, steps=1, collect=["ledger"]), timeout=100)
    for r in out:
        est = estimate_memory(LLAMA, plan, r["coords"]["pp"])
        assert r["ledger"]["parameters"] == est.params, (r["coords"], r["ledger"], est)
        assert r["ledger"]["gradients"] == est.grads


LLAMA_ACTIVATION_CASES = [("none", "explicit"), ("none", "sdpa"), ("selective", "explicit")]


@pytest.fixture(scope="module")
def llama_activation_runs():
    """{(policy, attention): the 1-rank result}, the three runs in one process (not a launch each)."""
    from tests.threed_workers import run_specs

    specs = [make_spec(LLAMA, Plan(global_batch=8, micro_batches=2, recompute=p, attention=a), steps=1,
                       collect=["activations"]) for p, a in LLAMA_ACTIVATION_CASES]
    (runs,) = launch(run_specs, 1, specs, timeout=100)
    return dict(zip(LLAMA_ACTIVATION_CASES, runs))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy,attention", LLAMA_ACTIVATION_CASES)
def test_llama_activations_within_15_percent_of_the_measured_ledger(policy, attention, llama_activation_runs):
    plan = Plan(global_batch=8, micro_batches=2, recompute=policy, attention=attention)
    r = llama_activation_runs[(policy, attention)]
    measured = sum(r["activations"].values())
    est = estimate_memory(LLAMA, plan, 0).activations
    assert abs(est - measured) / measured < 0.15, (policy, attention, est, measured)


def test_estimate_llama_70b_on_8_a100s_reports_its_size_and_why_it_does_not_fit(capsys):
    args = ["estimate", "--model", "llama-3.1-70b", "--gpus", "8", "--gpu", "A100-80GB"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "llama-3.1-70b (llama, 70.6B parameters)" in text
    assert "too much" in text and "70.55e9 parameters" in text and "80.0 GiB" in text
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 70_553_706_496 and out["fits"] is False
    assert "model states" in out["explanation"]


def test_family_flags_on_the_command_line(capsys):
    base = ["estimate", "--model", "tiny", "--json", "--seq-len", "64"]
    assert main(base + ["--family", "llama", "--kv-heads", "2", "--rope-base", "5e5",
                        "--tie-embeddings"]) == 0
    cfg = dataclasses.replace(PRESETS["tiny"], family="llama", n_kv_heads=2, activation="",
                              tie_embeddings=True)
    assert json.loads(capsys.readouterr().out)["params"] == cfg.n_params()
    assert main(base + ["--family", "llama", "--kv-heads", "3"]) == 2
    assert "n_kv_heads=3 does not divide n_heads=4" in capsys.readouterr().err
    assert main(["train", "--family", "llama", "--kv-heads", "2", "--tp", "4", "--dry-run"]) == 2
    assert "tp=4 does not divide n_kv_heads=2" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_train_from_hf_and_resume_an_import_in_another_layout(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf")
    flags = ["--steps", "1", "--seq-len", "32", "--global-batch", "4", "--micro-batches", "2",
             "--no-progress", "--timeout", "200"]
    log1, log2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["train", "--init-from-hf", str(tmp_path / "hf"), "--tp", "2",
                 "--log-jsonl", str(log1)] + flags) == 0
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    shape = ["--family", "llama", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
             "--ffn", "48", "--tie-embeddings"]
    assert main(["train", "--resume", str(tmp_path / "ckpt"), "--pp", "2", "--log-jsonl", str(log2),
                 "--save", str(tmp_path / "pp2")] + shape + flags) == 0
    # export-hf of a two-stage checkpoint (the tied matrix saved once, by stage 0): HF loads it
    from mini3d.checkpoint.store import latest_dir, read_states

    assert main(["export-hf", str(tmp_path / "pp2"), str(tmp_path / "out")]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    trained = read_states(latest_dir(str(tmp_path / "pp2")))["model"]["embed.wte.weight"]
    assert torch.equal(back.lm_head.weight, trained) and torch.equal(back.model.embed_tokens.weight, trained)
    first = [json.loads(line)["loss"] for line in open(log1)]
    resumed = [json.loads(line)["loss"] for line in open(log2)]
    assert first == pytest.approx(resumed, abs=1e-5)  # same weights, same batches: tp2 vs pp2
    from mini3d.data.corpus import Batches, load_tokens

    x, y = Batches(load_tokens(), 32, 4, 0).global_batch_at(0)  # the batch of step 1 (seed 0)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert first[0] == pytest.approx(want, abs=1e-5)  # the run started from the HF weights


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,layout", [("qwen3", ["--tp", "2"]), ("qwen3_moe", []),
                                         ("mixtral", ["--dp", "2"])],
                         ids=["qwen3-tp2", "qwen3-moe", "mixtral-dp2"])
def test_train_init_from_hf_starts_from_the_hf_weights(kind, layout, tmp_path):
    """`train --init-from-hf` of a Qwen3 (sharded over tp=2: its q/k norms replicated), a
    Qwen3-MoE and a Mixtral directory (MoE: no tp, see RunConfig): the first step's loss is
    transformers' loss on the same batch."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import moe_config, qwen_config, saved

    cfg = (qwen_config if kind == "qwen3" else moe_config)(kind, vocab_size=256,
                                                           max_position_embeddings=128)
    hf = saved(cfg, tmp_path / "hf").eval()
    log = tmp_path / "a.jsonl"
    assert main(["train", "--init-from-hf", str(tmp_path / "hf"), "--log-jsonl", str(log),
                 "--steps", "1", "--seq-len", "32", "--global-batch", "4", "--micro-batches", "2",
                 "--no-progress", "--timeout", "250"] + layout) == 0
    from mini3d.data.corpus import Batches, load_tokens

    x, y = Batches(load_tokens(), 32, 4, 0).global_batch_at(0)  # the batch of step 1 (seed 0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    first = json.loads(log.read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(want, abs=1e-5), (first, want)


def test_qwen_flags_on_the_command_line(capsys):
    """--family qwen2|qwen3 --head-dim --qk-norm --qkv-bias reach the model; a family's own
    feature turned off is exit 2 naming it."""
    base = ["estimate", "--model", "tiny", "--json", "--seq-len", "64"]
    assert main(base + ["--family", "qwen3", "--head-dim", "24", "--kv-heads", "2"]) == 0
    cfg = dataclasses.replace(PRESETS["tiny"], family="qwen3", explicit_head_dim=24, n_kv_heads=2,
                              activation="")
    assert cfg.qk_norm and cfg.q_dim == 96 != cfg.d_model
    assert json.loads(capsys.readouterr().out)["params"] == cfg.n_params()
    assert main(base + ["--family", "llama", "--qkv-bias", "--qk-norm"]) == 0
    both = dataclasses.replace(PRESETS["tiny"], family="llama", activation="", qkv_bias=True,
                               qk_norm=True)
    plain = dataclasses.replace(both, qkv_bias=False, qk_norm=False)
    assert json.loads(capsys.readouterr().out)["params"] == both.n_params() > plain.n_params()
    assert main(base + ["--family", "qwen2", "--no-qkv-bias"]) == 2
    assert "--family qwen2 --no-qkv-bias" in capsys.readouterr().err
    assert main(["train", "--family", "qwen3", "--no-qk-norm", "--dry-run"]) == 2
    assert "use --family llama" in capsys.readouterr().err

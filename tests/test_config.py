import pytest

from jaxtrain.config import ConfigError, load_config, load_recipe, from_dict


def test_recipes_load_and_derive():
    tiny = load_config("configs/tiny.py")
    assert tiny.model.num_layers == 4
    c70 = load_config("configs/llama70b.py")
    m = c70.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.mlp_size, m.vocab_size,
            m.rope_theta, c70.train.seq_len, c70.train.global_batch) == (
        80, 8192, 64, 8, 28672, 128256, 500000.0, 8192, 512)
    c405 = load_config("configs/llama405b.py")
    assert c405.model.num_layers == 126 and c405.model.rope_scaling is not None
    assert load_config("configs/llama3_8b.py").model.hidden_size == 4096


def test_overrides_are_typed():
    cfg = load_config("configs/tiny.py", ["--train.steps=20", "--parallel.tensor=2",
                                          "train.lr=1e-3", "--remat.modules=core_attn,mlp",
                                          "--config.model.tie_embeddings=true",
                                          "--model.rope_scaling.factor=4"])
    assert cfg.train.steps == 20 and isinstance(cfg.train.steps, int)
    assert cfg.parallel.tensor == 2 and cfg.train.lr == 1e-3
    assert cfg.remat.modules == ("core_attn", "mlp")
    assert cfg.model.tie_embeddings is True
    assert cfg.model.rope_scaling.factor == 4.0


@pytest.mark.parametrize("override, message", [
    ("--train.stepz=3", "did you mean train.steps"),
    ("--trian.steps=3", "did you mean train"),
    ("--model.attention=palas", "did you mean 'pallas'"),
    ("--train.steps=ten", "expected an integer"),
    ("--model.tie_embeddings=maybe", "expected a boolean"),
    ("--train.steps", "KEY=VALUE"),
    ("--model=3", "is a section"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.py", [override])


@pytest.mark.parametrize("overrides, message", [
    (["--model.num_kv_heads=3"], "num_heads=4 is not divisible by model.num_kv_heads=3"),
    (["--train.seq_len=1024"], "exceeds model.max_seq_len"),
    (["--parallel.microbatches=3"], "not divisible by parallel.microbatches=3"),
    (["--parallel.data=3"], "global_batch=16 is not divisible by parallel.data=3"),
    (["--parallel.sequence_parallel=true"], "needs parallel.tensor > 1"),
    (["--data.source=text"], "needs data.path"),
    (["--parallel.data=-1", "--parallel.fsdp=-1"], "only one of"),
])
def test_invalid_configs_fail_early(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.py", overrides)


MOE = "--model.moe.num_experts=8"


@pytest.mark.parametrize("override, message", [
    ("--model.moe.top_k=9", r"model.moe.top_k=9 is outside \[1, model.moe.num_experts=8\]"),
    ("--model.moe.top_k=0", r"model.moe.top_k=0 is outside \[1,"),
    ("--model.moe.capacity_factor=0", "model.moe.capacity_factor=0.0 must be > 0"),
    ("--model.moe.capacity_factor=-1.5", "model.moe.capacity_factor=-1.5 must be > 0"),
    ("--model.moe.first_k_dense=4", "leave no MoE layer among model.num_layers=4"),
    ("--model.moe.layer_freq=0", "model.moe.layer_freq=0 must be >= 1"),
    ("--model.moe.pad_to_capacity=true", "pad_to_capacity=true needs model.moe.dispatch=capacity"),
    ("--model.moe.aux_loss_coeff=-0.1", "aux_loss_coeff=-0.1 must be >= 0"),
    ("--model.moe.top_k=1", "set model.moe.pre_softmax=true"),
    ("--model.moe.score_function=tanh", "choose one of softmax, sigmoid"),
])
def test_bad_moe_configs_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config("configs/tiny.py", [MOE, override])
    assert "\n" not in str(err.value)


def test_moe_section_is_created_by_overrides_and_round_trips():
    cfg = load_config("configs/tiny.py", [MOE, "--model.moe.layer_freq=2",
                                          "--model.moe.first_k_dense=1",
                                          "--model.moe.shared_experts=2"])
    assert cfg.model.moe_layers == (False, False, True, False)   # i >= 1 and i % 2 == 0
    assert cfg.model.shared_mlp_size == 2 * cfg.model.mlp_size
    assert from_dict(__import__("json").loads(cfg.to_json())) == cfg
    assert load_config("configs/tiny.py").model.moe_layers == (False,) * 4


@pytest.mark.parametrize("overrides, message", [
    ([MOE, "--parallel.expert=3"], "num_experts=8 is not divisible by parallel.expert=3"),
    (["--parallel.expert=2"], "parallel.expert=2 with no MoE layer"),
    ([MOE, "--parallel.expert=4", "--parallel.tensor=4"],
     "expert=4 does not divide data=2 .the expert ranks are carved out"),
    ([MOE, "--parallel.expert=2", "--parallel.data=4", "--parallel.tensor=4"],
     "needs 16 devices but there are 8"),
    ([MOE, "--parallel.expert=0"], "parallel.expert=0 must be >= 1"),
    ([MOE, "--parallel.stage=2", "--model.moe.layer_freq=2"],
     "parallel.stage=2 with dense layers among the MoE ones"),
    ([MOE, "--parallel.expert=2", "--model.moe.dispatch=capacity",
      "--model.moe.pad_to_capacity=true"], "pad_to_capacity=true with parallel.expert=2"),
])
def test_bad_expert_layouts_are_one_line_errors_before_anything_is_built(overrides, message):
    from jaxtrain import config_check
    with pytest.raises(ConfigError, match=message) as err:
        config_check.check(load_config("configs/tiny.py", overrides), 8)
    assert "\n" not in str(err.value)


def test_an_moe_model_passes_the_checks_on_an_expert_layout():
    from jaxtrain import config_check
    cfg = load_config("configs/tiny.py", [MOE, "--parallel.expert=4", "--parallel.tensor=2"])
    assert config_check.check(cfg, 8).data == 4


def test_missing_recipe_file():
    with pytest.raises(ConfigError, match="no such file"):
        load_recipe("configs/nope.py")


def test_config_json_round_trip():
    cfg = load_config("configs/llama405b.py")
    again = from_dict(__import__("json").loads(cfg.to_json()))
    assert again == cfg


@pytest.mark.parametrize("text, seconds", [
    ("", 0), ("3600", 3600), ("90m", 5400), ("1h30m", 5400), ("23.5h", 84600), ("2d", 172800),
    ("10:00", 600), ("23:50:00", 85800), ("1-12", 129600), ("1-12:30", 131400),
    ("2-00:00:30", 172830)])
def test_max_runtime_takes_seconds_units_and_slurm_times(text, seconds):
    cfg = load_config("configs/tiny.py", [f"--train.max_runtime={text}"])
    assert cfg.train.max_runtime_s == seconds


@pytest.mark.parametrize("text", ["soon", "5x", "1:2:3:4", "-5", "1.5:00"])
def test_malformed_max_runtime_fails_at_load(text):
    with pytest.raises(ConfigError, match=r"train.max_runtime=.* is not a duration; write "
                                          r"seconds \(3600\)"):
        load_config("configs/tiny.py", [f"--train.max_runtime={text}"])

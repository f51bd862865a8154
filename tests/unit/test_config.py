"""Config files: schema, unknown keys named with the file, sizes, secrets from the environment, YAML."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tiercache.config import Config, config_from_dict, load_config
from tiercache.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_design_schema_example_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(
        tmp_path,
        """
chunk_size = 256
save_unfull_chunk = true
[l1]
capacity = "8GiB"
[[tiers]]
name = "nvme"
url = "nvme+slab:///mnt/nvme/tiercache.slab"
capacity = "500GiB"
codecs = ["raw"]
[[tiers]]
name = "shared"
url = "redis://10.0.0.5:6379/0"
capacity = "200GiB"
codecs = ["raw"]
options = { password_env = "REDIS_PASSWORD", pool_size = 32 }
[[tiers]]
name = "bucket"
url = "s3://kv-bucket/prefix"
options = { endpoint_url = "http://127.0.0.1:9000" }
""",
    )
    config = load_config(path)
    assert isinstance(config, Config)
    assert config.l1.capacity == 8 << 30
    assert [t.name for t in config.tiers] == ["nvme", "shared", "bucket"]
    assert config.tiers[0].capacity == 500 << 30
    assert config.tiers[2].capacity is None
    assert config.tiers[2].codecs == ("raw",)
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    assert config.tier("shared").adapter_options() == {
        "password": "s3cret",
        "pool_size": 32,
        "capacity": 200 << 30,
    }
    monkeypatch.delenv("REDIS_PASSWORD")
    with pytest.raises(ConfigError, match="'REDIS_PASSWORD', which is not set"):
        config.tier("shared").adapter_options()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("chunk_sise = 256", "'chunk_sise'"),
        ("[l1]\ncapcity = 1", "'l1.capcity'"),
        ("[manager]\nl2_deadline = 1", "'manager.l2_deadline'"),
        ('[[tiers]]\nname = "a"\nurl = "file:///x"\ncodec = ["raw"]', "'tiers[0].codec'"),
    ],
)
def test_unknown_keys_are_named_with_the_file(tmp_path: Path, text: str, named: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: unknown config key {named}")):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('chunk_size = "256"', "chunk_size must be int"),
        ("chunk_size = 0", r"chunk_size must be in \[1, 1048576\], got 0"),
        ("save_unfull_chunk = 1", "save_unfull_chunk must be bool"),
        ('[l1]\ncapacity = "8 parsecs"', "l1.capacity"),
        ('[[tiers]]\nurl = "file:///x"', "name is required"),
        ('[[tiers]]\nname = "a"', "url is required"),
        (
            '[[tiers]]\nname = "a"\nurl = "file:///x"\n[[tiers]]\nname = "a"\nurl = "file:///y"',
            "duplicate tier",
        ),
        ('[[tiers]]\nname = "a"\nurl = "redis://:pw@h:6379"', "must not carry a password"),
        ('[[tiers]]\nname = "a"\nurl = "redis://h"\noptions = { password = "x" }', "use password_env"),
        ('[[tiers]]\nname = "a"\nurl = "s3://b/p"\noptions = { secret_access_key = "x" }', "use secret_"),
        ('[[tiers]]\nname = "a"\nurl = "file:///x"\ncodecs = ["nosuchcodec"]', "nosuchcodec"),
        ('[[tiers]]\nname = "a"\nurl = "file:///x"\ncodecs = [3]', "each codec is an id"),
        ('[[tiers]]\nname = "a"\nurl = "file://${TC_UNSET_VAR}/x"', "'TC_UNSET_VAR' is not set"),
        ("this is = not toml", "invalid TOML"),
        ("[manager]\nl2_read_mib_per_s = 0", r"l2_read_mib_per_s must be in \[0.001, 1048576\], got 0"),
        ("[manager]\nl2_read_parallel = 0", r"l2_read_parallel must be in \[1, 1024\], got 0"),
    ],
)
def test_bad_values_are_clear_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.toml")


def test_url_environment_expansion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TC_DIR", "/data/x")
    config = config_from_dict(
        {
            "tiers": [
                {"name": "a", "url": "file://${TC_DIR}/l2"},
                {"name": "b", "url": "file://${TC_NOPE:-/tmp/d}/l2"},
            ]
        }
    )
    assert [t.url for t in config.tiers] == ["file:///data/x/l2", "file:///tmp/d/l2"]


def test_configs_are_frozen() -> None:
    config = config_from_dict({"tiers": [{"name": "a", "url": "file:///x", "options": {"fsync": True}}]})
    with pytest.raises(AttributeError):
        config.chunk_size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.tiers[0].options["fsync"] = False  # type: ignore[index]


def test_yaml_and_toml_examples_agree() -> None:
    toml = load_config(EXAMPLES / "embedded.toml")
    yaml = load_config(EXAMPLES / "embedded.yaml")
    assert toml.tiers == yaml.tiers
    assert toml.l1 == yaml.l1
    assert toml.chunk_size == yaml.chunk_size == 256


def test_every_example_config_loads() -> None:
    for path in sorted(EXAMPLES.glob("*.toml")):
        assert load_config(path).tiers, path


# -- secrets in URLs ---------------------------------------------------------------------

PLANTED = "Pw7Secret/xyz"  # contains "/", which ends the authority for a strict URL parser

SECRET_URLS = [
    f"redis://default:{PLANTED}@127.0.0.1:1/0",
    f"redis://:{PLANTED}@127.0.0.1:1",
    f"rediss://user:{PLANTED}?x#y@127.0.0.1:1/0",
    f"redis+cluster://u:{PLANTED}@127.0.0.1:1,127.0.0.1:2",
    f"redis://127.0.0.1:1/0?password={PLANTED}",
    f"redis://127.0.0.1:1/0?pass={PLANTED}",
    f"s3://bucket/prefix?aws_secret_access_key={PLANTED}",
    f"s3://bucket/prefix?access_key={PLANTED}",
    f"s3://bucket/prefix?session_token={PLANTED}",
    f"s3://bucket/prefix?endpoint_url=http://ak:{PLANTED}@127.0.0.1:1",
    f"mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata&token={PLANTED}",
    f"file:///tmp/x?api-key={PLANTED}",
]


@pytest.mark.parametrize("url", SECRET_URLS)
def test_url_with_a_secret_is_refused_without_echoing_it(url: str) -> None:
    from tiercache.config import check_url_secrets, redact_url

    with pytest.raises(ConfigError, match="_env") as info:
        check_url_secrets(url, "tier 'a'")
    assert PLANTED not in str(info.value)
    for piece in PLANTED.split("/"):
        assert piece not in str(info.value)
        assert piece not in redact_url(url)
    assert "***" in redact_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://alice@127.0.0.1:6379/0?password_env=REDIS_PASSWORD",
        "s3://bucket/prefix@v2/x",
        "s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&key_prefix=a",
        "file:///data/a@b?capacity=1GiB",
        "nvme+slab:///mnt/nvme/x.slab?capacity=500GiB&max_object=64MiB",
        "redis://h:6379/0?ssl_keyfile=/etc/k.pem&ssl_certfile=/etc/c.pem",
    ],
)
def test_urls_without_secrets_pass_and_print_unchanged(url: str) -> None:
    from tiercache.config import check_url_secrets, redact_url

    check_url_secrets(url, "tier 'a'")
    expected = url.replace("alice@", "***@")
    assert redact_url(url) == expected


def test_secret_in_an_expanded_variable_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``?password=${VAR}`` used to pass validation (the value appears only after expansion)."""
    monkeypatch.setenv("TC_PLANTED", PLANTED)
    for url in ("redis://h:1/0?password=${TC_PLANTED}", "redis://default:${TC_PLANTED}@h:1/0"):
        with pytest.raises(ConfigError, match="password_env") as info:
            load_config(write(tmp_path, f'[[tiers]]\nname = "a"\nurl = "{url}"'))
        assert PLANTED not in str(info.value)


def test_l2_read_deadline_scales_with_bytes(tmp_path: Path) -> None:
    """floor + bytes / (l2_read_mib_per_s MiB/s): a 512 MiB read at 256 MiB/s gets 2 s more."""
    cfg = load_config(
        write(tmp_path, "[manager]\nl2_read_floor_s = 1.5\nl2_read_mib_per_s = 256\nl2_read_parallel = 8")
    )
    assert cfg.manager.l2_read_parallel == 8
    assert cfg.manager.l2_read_deadline_s(0) == 1.5
    assert cfg.manager.l2_read_deadline_s(512 * 2**20) == pytest.approx(3.5)

"""kestreld.service.config: priorities (argv > env > file > defaults), parsing, validation."""
from __future__ import annotations

import os

import pytest

from kestreld import protocol
from kestreld.service.config import Config, DEFAULT_SOCKET, load_config, read_config_file


def test_defaults_without_file_or_env(tmp_path):
    empty = tmp_path / "empty.conf"
    empty.write_text("")
    cfg = load_config(["--config", str(empty)], environ={})
    assert cfg.socket == DEFAULT_SOCKET == protocol.DEFAULT_SOCKET
    assert (cfg.max_seq, cfg.max_queue, cfg.max_message_bytes, cfg.socket_mode) == \
        (8192, 16, 8 << 20, 0o660)
    assert (cfg.max_outgoing_bytes, cfg.shutdown_grace, cfg.prefix_kv) == (1 << 20, 10, True)
    assert cfg.interleave is True and cfg.memory_check is True


def test_priority_argv_over_env_over_file(tmp_path):
    conf = tmp_path / "k.conf"
    conf.write_text("# comment\nmax-seq = 1024\nmax-queue = 3   # trailing\nno-prefix-kv\n"
                    "socket-mode = 0600\nshutdown-grace = 2\nmax-outgoing-bytes = 4096\n")
    env = {"KESTREL_MAX_SEQ": "2048", "KESTREL_SOCKET": "/tmp/env.sock"}
    cfg = load_config(["--config", str(conf), "--max-queue", "5"], environ=env)
    assert cfg.config_file == str(conf)
    assert (cfg.max_seq, cfg.max_queue, cfg.socket) == (2048, 5, "/tmp/env.sock")
    assert (cfg.prefix_kv, cfg.socket_mode, cfg.shutdown_grace, cfg.max_outgoing_bytes) == \
        (False, 0o600, 2, 4096)
    cfg = load_config(["--max-seq", "300"], environ={"KESTREL_CONFIG": str(conf), **env})
    assert (cfg.max_seq, cfg.max_queue) == (300, 3)


def test_switches_that_turn_something_off(tmp_path):
    conf = tmp_path / "k.conf"
    conf.write_text("no-interleave\nno-memory-check\n")
    cfg = load_config(["--config", str(conf)], environ={})
    assert (cfg.interleave, cfg.memory_check, cfg.prefix_kv) == (False, False, True)
    empty = tmp_path / "empty.conf"
    empty.write_text("")
    cfg = load_config(["--config", str(empty), "--no-interleave"], environ={})
    assert (cfg.interleave, cfg.memory_check) == (False, True)


def test_config_file_errors_name_the_line(tmp_path):
    conf = tmp_path / "bad.conf"
    conf.write_text("max-seq = 10\nmax-sequence = 5\n")
    with pytest.raises(ValueError, match=r"bad.conf:2"):
        read_config_file(str(conf))


@pytest.mark.parametrize("field, value, needle", [
    ("max_seq", 0, "max-seq"), ("max_queue", 0, "max-queue"), ("kv_bs", 24, "power of two"),
    ("threads", -1, "threads"), ("max_outgoing_bytes", 0, "max-outgoing-bytes"),
    ("shutdown_grace", -1, "shutdown-grace"), ("pooling", "max", "pooling must be one of"),
])
def test_invalid_values_are_refused(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        Config(**{field: value})


def test_cli_flags_for_daemon_options(tmp_path):
    empty = tmp_path / "empty.conf"
    empty.write_text("")
    cfg = load_config(["--config", str(empty), "--socket", "/tmp/x.sock", "--max-message-bytes", "1000",
                       "--max-outgoing-bytes", "2000", "--shutdown-grace", "0",
                       "--socket-group", "kestrel", "--no-prefix-kv"], environ={})
    assert (cfg.socket, cfg.max_message_bytes, cfg.max_outgoing_bytes, cfg.shutdown_grace,
            cfg.socket_group, cfg.prefix_kv) == ("/tmp/x.sock", 1000, 2000, 0, "kestrel", False)


def test_kv_memory_from_argv_and_file(tmp_path):
    conf = tmp_path / "k.conf"
    conf.write_text("kv-memory = 268435456\n")
    assert load_config(["--config", str(conf)], environ={}).kv_memory == 256 << 20
    assert load_config(["--config", str(conf), "--kv-memory", "0"], environ={}).kv_memory == 0
    conf.write_text("")
    assert load_config(["--config", str(conf)], environ={}).kv_memory is None   # by RAM
    with pytest.raises(ValueError, match="kv-memory must be >= 0"):
        Config(kv_memory=-1)
    with pytest.raises(ValueError, match="cannot be used with no-prefix-kv"):
        Config(kv_memory=1 << 20, prefix_kv=False)
    assert Config(kv_memory=0, prefix_kv=False).kv_memory == 0


def test_mmproj_from_argv_env_and_file(tmp_path):
    conf = tmp_path / "k.conf"
    conf.write_text("model = /m/text.gguf\nmmproj = /m/mmproj-file.gguf\n")
    assert load_config(["--config", str(conf)], environ={}).mmproj == "/m/mmproj-file.gguf"
    env = {"KESTREL_CONFIG": str(conf), "KESTREL_MMPROJ": "/m/mmproj-env.gguf"}
    assert load_config([], environ=env).mmproj == "/m/mmproj-env.gguf"
    assert load_config(["--mmproj", "/m/mmproj-argv.gguf"], environ=env).mmproj == \
        "/m/mmproj-argv.gguf"
    empty = tmp_path / "empty.conf"
    empty.write_text("")
    assert load_config(["--config", str(empty)], environ={}).mmproj is None


def test_config_errors_name_the_file_and_line(tmp_path):
    conf = tmp_path / "k.conf"
    conf.write_text("# comment\nmax-seq = 4096\nmax-queue = lots\n")
    with pytest.raises(ValueError, match=r"k\.conf:3: max-queue: invalid literal"):
        load_config(["--config", str(conf)], environ={})
    conf.write_text("max-queue = 4\n\nmax-seq = 0\n")
    with pytest.raises(ValueError, match=r"k\.conf:3: max-seq must be >= 1"):
        load_config(["--config", str(conf)], environ={})
    # set on the command line, the value is not the file's
    with pytest.raises(ValueError, match=r"^max-seq must be >= 1"):
        load_config(["--config", os.devnull, "--max-seq", "0"], environ={})


def test_a_fifo_as_config_file_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "fifo.conf"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load_config(["--config", str(fifo)], environ={})


def test_alias_from_argv_and_file_adds_up(tmp_path):
    conf = tmp_path / "k.conf"
    conf.write_text("alias = qwen3-vl:2b\nalias = llama3.2\n")
    assert load_config(["--config", str(conf)], environ={}).alias == ("qwen3-vl:2b", "llama3.2")
    cfg = load_config(["--config", str(conf), "--alias", "a:1", "--alias", "b"], environ={})
    assert cfg.alias == ("a:1", "b")            # argv replaces the file's list
    for bad in ("", "two words", "x" * 201):
        with pytest.raises(ValueError, match="alias"):
            Config(alias=(bad,))


def test_strict_model_from_flag_and_file(tmp_path):
    assert not load_config([], environ={}).strict_model
    assert load_config(["--strict-model"], environ={}).strict_model
    conf = tmp_path / "k.conf"
    conf.write_text("strict-model = true\n")
    assert load_config(["--config", str(conf)], environ={}).strict_model


def test_pooling_from_argv_and_file(tmp_path):
    conf = tmp_path / "k.conf"
    conf.write_text("pooling = mean\n")
    assert load_config(["--config", str(conf)], environ={}).pooling == "mean"
    assert load_config(["--config", str(conf), "--pooling", "cls"], environ={}).pooling == "cls"
    conf.write_text("")
    assert load_config(["--config", str(conf)], environ={}).pooling is None   # the file's

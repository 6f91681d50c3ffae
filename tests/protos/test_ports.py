"""protos.ports: a busy or impossible address is a ConfigError naming the flag to change."""

from __future__ import annotations

import pytest

from protos.errors import ConfigError
from protos.ports import check_port_free


def test_a_port_in_use_is_a_config_error_that_says_so(busy_port: int) -> None:
    with pytest.raises(ConfigError, match=f"port {busy_port} on 127.0.0.1 is in use: choose"):
        check_port_free("127.0.0.1", busy_port)
    with pytest.raises(ConfigError, match=r"cannot listen on nosuchhost\.invalid:"):
        check_port_free("nosuchhost.invalid", busy_port)
    check_port_free("127.0.0.1", 0)  # a free one is picked
    with pytest.raises(ConfigError, match="choose another --kv-port"):
        check_port_free("127.0.0.1", busy_port, "--kv-port")


def test_port_0_still_checks_that_the_host_is_one_of_this_machines() -> None:
    # `tandem decode --kv-host 8.8.8.8` (--kv-port 0) was an OSError traceback once the model
    # had loaded; the check skipped port 0 altogether
    with pytest.raises(ConfigError, match=r"cannot listen on 192\.0\.2\.1:0 .*check --kv-host"):
        check_port_free("192.0.2.1", 0, "--kv-port", "--kv-host")
    with pytest.raises(ConfigError, match=r"cannot listen on nosuchhost\.invalid:0"):
        check_port_free("nosuchhost.invalid", 0)
    check_port_free("127.0.0.1", 0)
    check_port_free("0.0.0.0", 0)

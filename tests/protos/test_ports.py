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

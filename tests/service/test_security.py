"""Bearer-token auth and TLS on the real server."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
import torch

from kvclient.client import KVClient
from kvclient.errors import KVCraftError, UnavailableError
from kvcraft.keys import ModelSpec

MODEL = ModelSpec("sec", 1, 1, 2, "float32").fingerprint()
LAYERS = [(torch.ones(1, 2, 2), torch.zeros(1, 2, 2))]


def test_tokens_guard_kvcache_and_admin_separately(start_server):
    server = start_server(auth_token="engine-secret", admin_token="admin-secret")
    with KVClient(server.address) as anon:
        with pytest.raises(KVCraftError) as e:
            anon.store(MODEL, [1, 2], LAYERS)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with KVClient(server.address, token="wrong") as bad:
        with pytest.raises(KVCraftError) as e:
            bad.lookup(MODEL, [1, 2])
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    with KVClient(server.address, token="engine-secret", admin_token="engine-secret") as engine:
        key = engine.store(MODEL, [1, 2], LAYERS).chunk_key
        with pytest.raises(KVCraftError) as e:  # the engine token is not the admin token
            engine.flush()
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    with KVClient(server.address, admin_token="admin-secret") as admin:
        assert admin.stats().variants == 1
        assert "auth_token = \"***\"" in admin.config()  # secrets masked
    with KVClient(server.address, token="engine-secret") as engine:
        assert engine.fetch(key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_server_speaks_tls_only(start_server, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = start_server(tls_cert=str(cert), tls_key=str(key))
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with KVClient(server.address, credentials=creds) as c:
        key_ = c.store(MODEL, [3, 4], LAYERS).chunk_key
        assert torch.equal(c.fetch(key_)[0][0], LAYERS[0][0])
    with KVClient(server.address, timeout=3) as plain:
        with pytest.raises(UnavailableError):
            plain.stats()


def _self_signed(tmp_path, name: str):
    key, cert = tmp_path / f"{name}-key.pem", tmp_path / f"{name}-cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return key, cert


def _refused_start(start_server, **settings) -> str:
    with pytest.raises(RuntimeError, match="exited with 2") as e:
        start_server(**settings)
    assert "Traceback" not in str(e.value)
    return str(e.value)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_client_ca_without_a_server_certificate_is_refused_at_start(start_server, tmp_path):
    _, ca = _self_signed(tmp_path, "ca")
    message = _refused_start(start_server, tls_client_ca=str(ca))
    assert "tls_client_ca" in message and "tls_cert" in message


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_key_that_does_not_match_its_certificate_is_named_at_start(start_server, tmp_path):
    _, cert = _self_signed(tmp_path, "a")
    other_key, _ = _self_signed(tmp_path, "b")
    message = _refused_start(start_server, tls_cert=str(cert), tls_key=str(other_key))
    assert "does not match" in message and str(other_key) in message
    message = _refused_start(start_server, name="data2", tls_cert=str(cert), tls_key=str(tmp_path / "missing.pem"))
    assert "tls_key" in message and "missing.pem" in message

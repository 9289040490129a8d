from __future__ import annotations

import base64
import json
import time
import uuid

import pytest

from sandbox import ToolError


@pytest.fixture(scope="module")
def cd(load_plugin):
    return load_plugin("codec")


@pytest.mark.parametrize(
    ("algorithm", "digest"),
    [
        ("md5", "900150983cd24fb0d6963f7d28e17f72"),
        ("sha1", "a9993e364706816aba3e25717850c26c9cd0d89d"),
        ("sha256", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
        ("sha3_256", "3a985da74fe225b2045c172d6bd390bd855f086e3e9d525b46bfe24511431532"),
    ],
)
def test_hash_known_vectors(cd, algorithm, digest):
    r = cd.module.hash_data("abc", algorithm)
    assert r.digest == digest and r.input_bytes == 3


def test_hash_input_and_output_encodings(cd):
    hexed = cd.module.hash_data("abc", "sha512").digest
    assert cd.module.hash_data("YWJj", "sha512", input_encoding="base64").digest == hexed
    assert cd.module.hash_data("61 62 63", "sha512", input_encoding="hex").digest == hexed
    b64 = cd.module.hash_data("abc", "sha512", output="base64").digest
    assert base64.b64decode(b64).hex() == hexed
    assert len(cd.module.hash_data("abc", "blake2b").digest) == 128
    with pytest.raises(ToolError, match="not valid base64"):
        cd.module.hash_data("not base64!", input_encoding="base64")


def test_hash_size_limit(cd):
    with pytest.raises(ToolError, match="too large"):
        cd.module.hash_data("a" * (8 * 1024 * 1024 + 1))


def test_hash_through_worker_rejects_unknown_algorithm(cd):
    assert "Invalid arguments" in cd.error("hash", data="x", algorithm="crc32")
    out = cd.call("hash", data="abc", algorithm="md5")
    assert out.structured["digest"] == "900150983cd24fb0d6963f7d28e17f72"


def test_hmac_rfc4231_vector_and_verification(cd):
    # RFC 4231 test case 2
    expected = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    r = cd.module.hmac("Jefe", "what do ya want for nothing?")
    assert r.digest == expected and r.matches is None
    assert cd.module.hmac("Jefe", "what do ya want for nothing?", expected=expected.upper()).matches is True
    assert cd.module.hmac("Jefe", "what do ya want for nothing?", expected="00" * 32).matches is False
    r = cd.module.hmac("4a656665", "what do ya want for nothing?", key_encoding="hex", output="base64")
    assert base64.b64decode(r.digest).hex() == expected


@pytest.mark.parametrize("scheme", ["base64", "base64url", "base32", "hex", "url", "url_form"])
def test_encode_decode_round_trip(cd, scheme):
    text = "héllo wörld/?&=+ ~"
    encoded = cd.module.encode(text, scheme).result
    decoded = cd.module.decode(encoded, scheme)
    assert decoded.result == text and decoded.output_encoding == "utf8"


def test_encode_known_values(cd):
    e = cd.module.encode
    assert e("hi?", "base64").result == "aGk/"
    assert e("hi?", "base64url").result == "aGk_"
    assert e("a", "base64", padding=False).result == "YQ"
    assert e("a", "base32").result == "ME======"
    assert e("a b/c", "url").result == "a%20b%2Fc"
    assert e("a b/c", "url_form").result == "a+b%2Fc"
    assert e("//79", "hex", input_encoding="base64").result == "fffefd"


def test_decode_binary_and_errors(cd):
    d = cd.module.decode
    assert d("//79", "base64").output_encoding == "base64"  # not UTF-8: auto falls back
    assert d("//79", "base64", output="hex").result == "fffefd"
    assert d("YQ", "base64").result == "a"  # missing padding tolerated
    assert d("me", "base32").result == "a"
    with pytest.raises(ToolError, match="not valid UTF-8"):
        d("//79", "base64", output="utf8")
    with pytest.raises(ToolError, match="not valid base64"):
        d("a$b", "base64")
    with pytest.raises(ToolError, match="not valid hex"):
        d("zz", "hex")


def test_uuid(cd):
    r = cd.module.make_uuid(5, name="python.org")
    assert r.uuids == ["886313e1-3b8a-5372-9b90-0c9aee199e5d"]  # the example in Python's docs
    custom = str(uuid.uuid4())
    assert cd.module.make_uuid(5, name="x", namespace=custom).uuids == [str(uuid.uuid5(uuid.UUID(custom), "x"))]
    many = cd.module.make_uuid(4, count=20).uuids
    assert len(set(many)) == 20 and all(uuid.UUID(u).version == 4 for u in many)
    with pytest.raises(ToolError, match="needs a name"):
        cd.module.make_uuid(5)
    with pytest.raises(ToolError, match="namespace"):
        cd.module.make_uuid(5, name="x", namespace="nope")
    assert "Invalid arguments" in cd.error("uuid", version=3)
    assert "Invalid arguments" in cd.error("uuid", count=1001)


def _b64url(obj) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


def test_jwt_decode_is_unverified(cd):
    token = (
        "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0"
        "IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
    )
    out = cd.call("jwt_decode", token="Bearer " + token)
    s = out.structured
    assert s["verified"] is False and "NOT verified" in s["warning"]
    assert s["header"] == {"alg": "HS256", "typ": "JWT"}
    assert s["payload"] == {"sub": "1234567890", "name": "John Doe", "iat": 1516239022}
    assert s["algorithm"] == "HS256"
    assert s["issued_at"] == "2018-01-18T01:30:22Z"
    assert s["expired"] is None
    assert "WITHOUT verifying its signature" in cd.tools["jwt_decode"].description


def test_jwt_expiry_and_big_numbers(cd):
    now = int(time.time())
    past = _b64url({"alg": "none"}) + "." + _b64url({"exp": now - 10, "big": 2**70}) + "."
    out = cd.call("jwt_decode", token=past)  # a >64-bit integer must still cross the channel
    assert out.structured["expired"] is True
    assert out.structured["payload"]["big"] == str(2**70)
    assert "unsigned" in out.structured["warning"]
    future = _b64url({"alg": "RS256"}) + "." + _b64url({"exp": now + 3600}) + ".sig"
    assert cd.module.jwt_decode(future).expired is False


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("abc", "3 dot-separated parts"),
        ("a.b.c.d.e", "encrypted"),
        ("!!!.e30.x", "not valid"),
        (_b64url([1]) + ".e30.x", "not a JSON object"),
        ("e30." + base64.urlsafe_b64encode(b"not json").decode() + ".x", "not JSON"),
    ],
)
def test_jwt_decode_errors(cd, token, message):
    with pytest.raises(ToolError, match=message):
        cd.module.jwt_decode(token)

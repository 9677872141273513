"""One identity per request (#56 item 4): the app authenticates by ``web/bearer.py``, the reading
the event loop shares threads by; a token that is not exactly a configured key is a 401, never
trimmed; keys no request could present are refused at start."""

from __future__ import annotations

import pytest

from tests.web.conftest import KEY_A, auth
from web.auth import KeyRing
from web.bearer import bearer_token


@pytest.mark.parametrize("header, token", [
    (f"Bearer {KEY_A}", KEY_A), (f"bearer {KEY_A}", KEY_A), (f"BEARER   {KEY_A}", KEY_A),
    ("Bearer abc+/=", "abc+/="), ("Bearer a.b_c~d-e==", "a.b_c~d-e=="),
    (f"Bearer {KEY_A}\xa0", None), (f"Bearer {KEY_A}\x85", None), (f"Bearer\xa0{KEY_A}", None),
    (f"Bearer\t{KEY_A}", None), (f"Bearer {KEY_A} ", None), (f" Bearer {KEY_A}", None),
    (f"Bearer {KEY_A} x", None), (f"Bearer {KEY_A},Bearer {KEY_A}", None), ("Bearer a=b", None),
    ("Bearer ", None), ("Bearer", None), (f"Basic {KEY_A}", None), (KEY_A, None), (None, None),
    (f"Bearer {KEY_A}\u212a", None), ("\u0412earer key", None),
])
def test_a_bearer_token_is_rfc_6750s_b64token_exactly(header, token):
    assert bearer_token(header) == token


@pytest.mark.parametrize("header", [f"Bearer {KEY_A}\xa0", f"Bearer {KEY_A}\x85", f"Bearer \xa0{KEY_A}",
                                    f"Bearer {KEY_A}\t", f"Bearer\t{KEY_A}", f"Bearer {KEY_A.upper()}"])
def test_a_padded_or_altered_key_is_401_not_its_key(client, header):
    response = client.get("/v1/jobs", headers={"Authorization": header})
    assert response.status_code == 401, header
    assert response.get_json()["code"] == "unauthorized"
    assert client.get("/v1/jobs", headers=auth()).status_code == 200


def test_the_scheme_is_any_case_and_separated_by_spaces(client):
    assert client.get("/v1/jobs", headers={"Authorization": f"bEaReR   {KEY_A}"}).status_code == 200


@pytest.mark.parametrize("key", ["has space", "t\xe4st", "a=b", "tab\tkey", ""])
def test_a_key_no_request_could_present_is_refused_at_start(key):
    with pytest.raises(ValueError, match="b64token"):
        KeyRing((key,))
    with pytest.raises(ValueError, match="b64token"):
        KeyRing(("fine",), (key,))

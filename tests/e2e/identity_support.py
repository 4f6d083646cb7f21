"""Tokens for the mesh-identity tests: an issuer's RSA key whose JWKS file Envoy's
jwt_authn filter reads, tokens signed with it, and a stack whose Envoy verifies them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from testbed import envoy_variants
from testbed.harness import Stack

ISSUER = "https://issuer.mesh.test"
PAYLOAD_KEY = "jwt_payload"


class Signer:
    """An issuer's RSA key: its JWKS file for Envoy, and tokens it signs."""

    def __init__(self, directory: Path) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        self.jwks = directory / "jwks.json"
        self.jwks.write_text(json.dumps({"keys": [{**public, "kid": "k1", "alg": "RS256"}]}))

    def token(self, *, expires_in: float = 300, issuer: str = ISSUER, **claims: Any) -> str:
        now = int(time.time())
        payload = {"iss": issuer, "iat": now, "exp": now + int(expires_in), **claims}
        return jwt.encode(payload, self.key, algorithm="RS256", headers={"kid": "k1"})


class JwtStack(Stack):
    def __init__(self, signer: Signer, **kwargs: Any) -> None:
        self.signer = signer
        super().__init__(**kwargs)

    def write_configs(self) -> None:
        super().write_configs()
        envoy_variants.verify_jwt(
            self.envoy_config_path,
            issuer=ISSUER,
            jwks_file=self.signer.jwks,
            payload_key=PAYLOAD_KEY,
        )

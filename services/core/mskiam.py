"""Amazon MSK's IAM login: the SASL/OAUTHBEARER token AWS's signer makes, handed to librdkafka.

An MSK cluster's IAM listener (port 9098, 9198 from outside its VPC) takes
OAUTHBEARER with a token no identity provider issues: a SigV4-presigned
``kafka-cluster:Connect`` request for the cluster's region, base64url
encoded, signed with the caller's AWS credentials.  AWS's own library,
``aws-msk-iam-sasl-signer-python``, makes it from botocore's credential chain
(environment variables, shared files, the web identity of an EKS service
account, a container or instance role), without a call to AWS: presigning is
local.  The token lives 15 minutes.

confluent-kafka runs ``oauth_cb`` on librdkafka's background thread when a
client is made and again before the token expires (at 80 % of its life), so
``MskIamToken`` is that callback.  The signer is an optional dependency
(``pip install sluice[msk]``; the Docker image has it): ``signer_problem()``
says why it cannot be used here, and the site file's check refuses the
method with that reason.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("sluice.mskiam")

#: The distribution that signs the tokens, and how to get it with Sluice.
SIGNER = "aws-msk-iam-sasl-signer-python"
INSTALL = "pip install sluice[msk]"


def signer_problem() -> str | None:
    """Why AWS's MSK signer cannot be used here, or None when it can."""
    try:
        importlib.import_module("aws_msk_iam_sasl_signer.MSKAuthTokenProvider")
    except ImportError as exc:
        return (f"needs the package {SIGNER}, which is not installed here ({exc}): {INSTALL} "
                "(the Sluice Docker image has it)")
    return None


@dataclass(frozen=True)
class MskIamToken:
    """confluent-kafka's ``oauth_cb`` for Amazon MSK's IAM login in ``region``.

    Called with librdkafka's ``sasl.oauthbearer.config`` (unused here), it
    answers ``(token, expiry in seconds since the epoch)``; the signer gives
    the expiry in milliseconds.
    """

    region: str

    def __call__(self, _oauthbearer_config: Any) -> tuple[str, float]:
        from aws_msk_iam_sasl_signer import MSKAuthTokenProvider

        try:
            token, expiry_ms = MSKAuthTokenProvider.generate_auth_token(self.region)
        except Exception:
            # librdkafka's background thread calls this, and a failure reaches the
            # client only as "OAuth token not set": say here why, then fail the login.
            log.exception("Amazon MSK IAM: no token for region %s: botocore's credential chain found no usable "
                          "AWS credentials (environment, shared files, web identity, container or instance role)",
                          self.region)
            raise
        return token, expiry_ms / 1000


__all__ = ["INSTALL", "SIGNER", "MskIamToken", "signer_problem"]

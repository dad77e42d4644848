"""ClientApp: the user's `clients` package supplies the client."""

from __future__ import annotations

from clients import make_client

from fedpdm_flower.clients.fedpdm import FedPDMClient

app = FedPDMClient.client_app(make_client)

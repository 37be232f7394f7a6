"""Operational surface: metrics, health endpoints, systemd, logging, deploy files, docs."""

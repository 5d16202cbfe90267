"""``--engine-metrics``: the router's ``/metrics`` also carries every healthy engine's series,
each sample labelled ``engine="host:port"``, so one scrape target covers engines that listen
on loopback only (``tandem serve --dp-size``).

The engines are scraped when the router is (concurrently, each bounded by the health-check
timeout); one that does not answer in time is left out of that scrape. Families of the same
name from several engines are merged into one, so every name has one HELP and TYPE line.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from router.workers import Worker


def engine_label(url: str) -> str:
    return urlsplit(url).netloc


async def _scrape(client: aiohttp.ClientSession, w: Worker, timeout: float) -> str | None:
    try:
        async with client.get(w.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
        return None


class _Families:
    """What ``generate_latest`` reads: an object whose ``collect`` yields metric families."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge(texts: dict[str, str]) -> bytes:
    """Prometheus text from ``{engine label: that engine's exposition}``, each sample labelled."""
    families: dict[str, object] = {}
    for label, text in texts.items():
        for fam in text_string_to_metric_families(text):
            samples = [Sample(s.name, {**s.labels, "engine": label}, s.value, s.timestamp, s.exemplar)
                       for s in fam.samples]
            kept = families.setdefault(fam.name, fam)
            if kept is fam:
                fam.samples = samples
            else:
                kept.samples.extend(samples)
    return generate_latest(_Families(list(families.values())))


async def engine_metrics(client: aiohttp.ClientSession, workers: list[Worker], timeout: float) -> bytes:
    """Every healthy worker's series, scraped now."""
    healthy = [w for w in workers if w.healthy and not w.removed]
    texts = await asyncio.gather(*(_scrape(client, w, timeout) for w in healthy))
    return merge({engine_label(w.url): text for w, text in zip(healthy, texts) if text is not None})

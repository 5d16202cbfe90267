"""Streams that record how they ended (tokens | error | refused | lost) and the engine
processes of a server, read from /proc: what ``ops_bench.py`` counts and kills (the operations
e2e tests use them too)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamEnd:
    status: int = 0
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False  # saw data: [DONE]
    retry_after: str | None = None
    ended_at: float = 0.0
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def outcome(self) -> str:
        """tokens | error | refused | lost (lost = neither tokens nor an explicit error)."""
        if self.status == 200 and self.done and self.error is None and self.finish_reason is not None:
            return "tokens"
        if self.status == 200 and self.done and self.error is not None:
            return "error"
        if self.status in (401, 503) and self.error is not None:
            return "refused"
        return "lost"


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, end: StreamEnd,
                            headers: dict | None = None) -> StreamEnd:
    try:
        async with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
            end.status = r.status_code
            end.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                end.error = json.loads(await r.aread()).get("error")
                return end
            async for line in r.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    end.done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    end.error = event["error"]
                    continue
                for choice in event.get("choices", []):
                    end.chunks += 1
                    end.text += choice.get("text", "")
                    end.finish_reason = choice.get("finish_reason") or end.finish_reason
                    end.first_chunk.set()
    except httpx.HTTPError as exc:  # a cut connection: counted as lost by ``outcome``
        end.error = end.error or {"transport": repr(exc)}
        end.done = False
    finally:
        end.ended_at = time.monotonic()
        end.first_chunk.set()
    return end


def children(pid: int) -> dict[int, str]:
    """{child pid: comm} of ``pid`` (zombies included: an unreaped child is an orphan-to-be)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out[int(entry)] = comm
    return out


def engine_children(pid: int) -> dict[str, int]:
    return {comm: p for p, comm in children(pid).items() if comm.startswith("tandem-")}

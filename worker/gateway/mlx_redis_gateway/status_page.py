"""The gateway's status page: one server-rendered HTML page, no build step, no external assets.

``render_page`` is the whole document; ``render_fragment`` is what its script fetches from
``/status/fragment`` every second and swaps in, so the page stays live without a reload. Every
string that comes from Redis (worker ids, model names, request ids, error messages) is escaped.
Elements carry stable ids, classes and ``data-`` attributes for tests and scripts.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable, Sequence
from typing import Final

from mlx_redis_gateway.browser_guard import script_csp
from mlx_redis_gateway.fleet_status import FleetStatus
from mlx_redis_protocol.catalogue import QueueStatus

# Said of every dead letter's message: it may quote what a job's producer sent.
_TENANT_TEXT: Final = "text from a job's producer or its request, shown as sent; not the gateway's"

# The plot's size in SVG units; it scales to the page's width.
_PLOT_WIDTH: Final = 1200
_PLOT_HEIGHT: Final = 180
_PLOT_LEFT, _PLOT_RIGHT, _PLOT_TOP, _PLOT_BOTTOM = 44, 24, 10, 24

_STYLE: Final = """
:root{--fg:#1d2330;--muted:#667085;--line:#e4e7ec;--bg:#f6f7f9;--card:#fff;--accent:#2f6fde;
--warn:#b54708;--bad:#b42318}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);font:14px/1.45 system-ui,-apple-system,
"Segoe UI",Roboto,sans-serif}
header{padding:14px 24px;background:var(--card);border-bottom:1px solid var(--line);display:flex;
align-items:baseline;gap:16px;flex-wrap:wrap}
header h1{font-size:17px;margin:0}
main{padding:16px 24px;max-width:1280px}
section{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:12px 16px;
margin-bottom:14px;overflow-x:auto}
h2{font-size:13px;margin:0 0 8px;text-transform:uppercase;letter-spacing:.04em;color:var(--muted)}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th:first-child,td:first-child{padding-left:0}th:last-child,td:last-child{padding-right:0}
th{font-weight:600;color:var(--muted);font-size:12px}
tr:last-child td{border-bottom:0}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
code{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.muted,.empty{color:var(--muted)}
.warn{color:var(--warn)}.bad{color:var(--bad);font-weight:600}
.model{display:inline-block;margin:0 10px 2px 0;white-space:nowrap}
.bar{display:inline-block;width:60px;height:7px;border-radius:4px;background:var(--line);
margin-left:6px;vertical-align:middle;overflow:hidden}
.bar i{display:block;height:100%;background:var(--accent)}
.message{max-width:520px;word-break:break-word}
.tenant-text{font-style:italic}.tenant-text::before{content:"\\201C"}
.tenant-text::after{content:"\\201D"}
.stats{display:flex;gap:24px;color:var(--muted)}.stats b{color:var(--fg)}
svg{width:100%;height:auto;display:block}
svg text{font:12px system-ui,sans-serif;fill:var(--muted)}
svg .grid{stroke:var(--line)}svg .line{fill:none;stroke:var(--accent);stroke-width:1.5}
svg .area{fill:var(--accent);opacity:.12}
#status[data-stale=true] .stamp::after{content:" \\2014 refresh failed, retrying";
color:var(--bad)}
"""

# setTimeout after each fetch, not setInterval: a slow gateway never gets requests piling up.
# The URL is relative so the page also works behind a proxy that mounts the gateway on a path.
_SCRIPT: Final = """
(function () {
  var box = document.getElementById("status");
  function refresh() {
    fetch("status/fragment", {cache: "no-store"})
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.text(); })
      .then(function (text) { box.innerHTML = text; box.dataset.stale = "false"; })
      .catch(function () { box.dataset.stale = "true"; })
      .finally(function () { setTimeout(refresh, 1000); });
  }
  setTimeout(refresh, 1000);
})();
"""


# The page's Content-Security-Policy: its one script, by hash; nothing loaded from elsewhere.
STATUS_PAGE_CSP: Final = script_csp(_SCRIPT)


def render_page(status: FleetStatus) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>mlx-redis-worker fleet</title><style>{_STYLE}</style></head><body>"
        "<header><h1>mlx-redis-worker fleet</h1>"
        '<span class="muted">refreshes every second</span></header>'
        f'<main id="status" data-stale="false">{render_fragment(status)}</main>'
        f"<script>{_SCRIPT}</script></body></html>"
    )


def render_fragment(status: FleetStatus) -> str:
    return (
        f'<div class="fragment" data-at="{status.at:.3f}">'
        f"{_summary(status)}{_workers(status)}{_queues(status)}{_throughput(status)}"
        f"{_tenants(status)}{_running(status)}{_dead_letters(status)}</div>"
    )


def _summary(status: FleetStatus) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(status.at))
    in_flight = sum(beat.in_flight for beat in status.fleet.heartbeats)
    return (
        f'<p class="stats" id="summary"><span class="stamp">as of {_e(stamp)}</span>'
        f"<span>{_count(len(status.fleet.heartbeats), 'worker')}</span>"
        f"<span>{_count(len(status.fleet.models), 'model')}</span>"
        f"<span><b>{in_flight}</b> in flight</span>"
        f"<span><b>{len(status.running)}</b> generating</span></p>"
    )


def _workers(status: FleetStatus) -> str:
    rows = []
    for beat in status.fleet.heartbeats:
        models = "".join(
            f'<span class="model" data-model="{_e(name)}" data-free="{m.free_slots}" '
            f'data-max="{m.max_concurrency}"><code>{_e(name)}</code> '
            f"{m.free_slots}/{m.max_concurrency} free{_bar(m.in_flight, m.max_concurrency)}"
            "</span>"
            for name, m in sorted(beat.models.items())
        )
        if not models:  # an older worker: it advertises only the model it calls its own
            models = f'<span class="muted">{_e(beat.default_model or "?")} (old worker)</span>'
        uptime = _duration(status.at - beat.started_at) if beat.started_at else "—"
        rows.append(
            f'<tr class="worker" data-worker-id="{_e(beat.worker_id)}">'
            f'<td><code class="worker-id">{_e(beat.worker_id)}</code></td><td>{models}</td>'
            f'<td class="num in-flight">{beat.in_flight}</td><td>{_e(beat.version or "—")}</td>'
            f'<td class="num">{uptime}</td><td class="num">{beat.pid}</td></tr>'
        )
    head = ("worker", "models (free / max slots)", "#in flight", "version", "#uptime", "#pid")
    return _section("workers", "Workers", head, rows, "no live workers")


def _takes(media: tuple[str, ...]) -> str:
    """What a model takes besides text (a vision-language model: images, videos)."""
    if not media:
        return ""
    return f' <span class="muted media">+ {_e(", ".join(f"{kind}s" for kind in media))}</span>'


def _queues(status: FleetStatus) -> str:
    rows = []
    for model in status.fleet.models:
        slots = f"{model.free_slots}/{model.max_concurrency}" if model.workers else "no workers"
        rows.append(
            f'<tr class="queue" data-model="{_e(model.model)}">'
            f"<td><code>{_e(model.model)}</code>{_takes(model.media)}</td>"
            f'<td class="num">{len(model.workers)}</td><td class="num">{slots}</td>'
            f"{_queue_cells(model.queue)}</tr>"
        )
    default = status.fleet.default
    targets = ", ".join(
        f"<code>{_e(name or '?')}</code> ({_count(count, 'worker')})"
        for name, count in default.default_models.items()
    )
    note = f" → {targets}" if targets else ""
    if default.disagreement:
        note += ' <span class="warn">(workers disagree)</span>'
    if default.old_workers:
        note += f' <span class="muted">({_count(len(default.old_workers), "old worker")})</span>'
    rows.append(
        f'<tr class="queue default-stream" data-model="">'
        f'<td><span class="muted">default stream</span>{note}</td>'
        f'<td class="num">{len(default.workers)}</td><td class="num">—</td>'
        f"{_queue_cells(default.queue)}</tr>"
    )
    head = ["model", "#workers", "#free/max", "#length", "#lag", "#pending", "#oldest pending"]
    head.append("#dead letters")
    return _section("queues", "Queues", head, rows, "")


def _queue_cells(queue: QueueStatus) -> str:
    lag = "—" if queue.lag is None else str(queue.lag)
    dead = f'<span class="bad">{queue.dead_letters}</span>' if queue.dead_letters else "0"
    return (
        f'<td class="num length">{queue.length}</td><td class="num lag">{lag}</td>'
        f'<td class="num pending">{queue.pending}</td>'
        f'<td class="num oldest">{_duration(queue.oldest_pending_seconds)}</td>'
        f'<td class="num dead">{dead}</td>'
    )


def _tenants(status: FleetStatus) -> str:
    """Fair share by model and tenant; no section at all while no model has fair share."""
    rows = [
        f'<tr class="tenant" data-model="{_e(model.model)}" data-tenant="{_e(share.tenant)}">'
        f"<td><code>{_e(model.model)}</code></td><td><code>{_e(share.tenant)}</code></td>"
        f'<td class="num queued">{share.queued}</td>'
        f'<td class="num served">{share.served_tokens}</td></tr>'
        for model in status.fleet.models
        for share in model.tenants
    ]
    if not rows:
        return ""
    head = ("model", "tenant", "#queued", "#tokens served (10 min)")
    return _section("tenants", "Fair share by tenant", head, rows, "")


def _running(status: FleetStatus) -> str:
    rows = []
    for item in status.running:
        request = item.activity
        age = max(status.at - request.started_at, 0.0) if request.started_at else None
        rate = f"{request.tokens / age:.1f}" if age else "—"
        rows.append(
            f'<tr class="running" data-request-id="{_e(request.request_id)}">'
            f"<td><code>{_e(request.request_id)}</code></td>"
            f"<td><code>{_e(request.model or '—')}</code></td>"
            f"<td><code>{_e(item.worker_id)}</code></td>"
            f'<td class="num">{request.attempt}</td>'
            f'<td class="num tokens" data-tokens="{request.tokens}">{request.tokens}</td>'
            f'<td class="num">{rate}</td><td class="num">{_duration(age)}</td></tr>'
        )
    head = ("request", "model", "worker", "#attempt", "#tokens", "#tokens/s", "#age")
    return _section("running", "Generating now", head, rows, "nothing is generating")


def _dead_letters(status: FleetStatus) -> str:
    rows = []
    for dead in status.dead_letters:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(dead.at)) if dead.at else ""
        ago = f"{_duration(status.at - dead.at)} ago" if dead.at else "—"
        deliveries = "—" if dead.deliveries is None else str(dead.deliveries)
        rows.append(
            f'<tr class="dead-letter" data-entry-id="{_e(dead.entry_id)}">'
            f'<td title="{_e(when)}">{ago}</td><td><code>{_e(dead.stream)}</code></td>'
            f"<td><code>{_e(dead.request_id or '—')}</code></td>"
            f'<td class="bad code">{_e(dead.code)}</td>'
            f'<td class="message tenant-text" title="{_TENANT_TEXT}">{_e(dead.message)}</td>'
            f'<td class="num">{deliveries}</td></tr>'
        )
    head = ("when", "stream", "request", "code", "message (tenant text)", "#deliveries")
    return _section("dead-letters", "Dead letters (newest)", head, rows, "no dead letters")


def _throughput(status: FleetStatus) -> str:
    points = status.throughput
    rates = [rate for _, rate in points]
    top = _nice_ceiling(max(rates, default=0.0))
    width = _PLOT_WIDTH - _PLOT_LEFT - _PLOT_RIGHT
    height = _PLOT_HEIGHT - _PLOT_TOP - _PLOT_BOTTOM
    bottom = _PLOT_TOP + height
    first, last = (points[0][0], points[-1][0]) if points else (0, 0)
    span = max(last - first, 1)

    def x(start: float) -> float:
        return _PLOT_LEFT + (start - first) / span * width

    def y(rate: float) -> float:
        return bottom - rate / top * height

    parts = []
    for value in (0.0, top / 2, top):
        parts.append(
            f'<line class="grid" x1="{_PLOT_LEFT}" x2="{_PLOT_LEFT + width}" '
            f'y1="{y(value):.1f}" y2="{y(value):.1f}"/><text x="{_PLOT_LEFT - 6}" '
            f'y="{y(value) + 4:.1f}" text-anchor="end">{_number(value)}</text>'
        )
    for minutes in range(0, span // 60 + 1):
        tick = x(last - minutes * 60)
        label = "now" if minutes == 0 else f"−{minutes} min"
        parts.append(
            f'<text x="{tick:.1f}" y="{_PLOT_HEIGHT - 6}" text-anchor="middle">{label}</text>'
        )
    if len(points) > 1:
        line = " ".join(f"{x(start):.1f},{y(rate):.1f}" for start, rate in points)
        parts.append(
            f'<polygon class="area" points="{_PLOT_LEFT},{bottom} {line} '
            f'{_PLOT_LEFT + width},{bottom}"/><polyline class="line" points="{line}"/>'
        )
    current = rates[-1] if rates else 0.0
    window = _duration(span + status.bucket_seconds)
    stats = (
        f'<p class="stats"><span>now <b class="rate-now">{_number(current)}</b> tokens/s</span>'
        f'<span>peak <b class="rate-peak">{_number(max(rates, default=0.0))}</b> tokens/s'
        f"</span><span>{status.bucket_seconds} s buckets</span></p>"
    )
    return (
        f'<section id="throughput"><h2>Tokens per second, last {window}</h2>{stats}'
        f'<svg viewBox="0 0 {_PLOT_WIDTH} {_PLOT_HEIGHT}" role="img" '
        f'aria-label="fleet tokens per second" data-max="{top:g}">{"".join(parts)}</svg></section>'
    )


def _section(ident: str, title: str, head: Sequence[str], rows: Iterable[str], empty: str) -> str:
    """A titled table; a heading that starts with ``#`` is a right-aligned number column."""
    cells = "".join(
        f'<th class="num">{_e(h[1:])}</th>' if h.startswith("#") else f"<th>{_e(h)}</th>"
        for h in head
    )
    body = "".join(rows)
    if not body:
        body = f'<tr><td class="empty" colspan="{len(head)}">{_e(empty)}</td></tr>'
    return (
        f'<section id="{ident}"><h2>{_e(title)}</h2>'
        f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table></section>"
    )


def _bar(used: int, total: int) -> str:
    share = min(max(used / total, 0.0), 1.0) if total > 0 else 0.0
    return f'<span class="bar" title="{used} in flight"><i style="width:{share:.0%}"></i></span>'


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above ``value`` (1 for nothing): a round axis top."""
    if value <= 1:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= value)


def _count(count: int, noun: str) -> str:
    return f"<b>{count}</b> {noun}{'' if count == 1 else 's'}"


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = max(seconds, 0.0)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    return f"{hours // 24} d {hours % 24} h"


def _e(text: str) -> str:
    return html.escape(text, quote=True)

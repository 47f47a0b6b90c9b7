"""Imported by the ranks' forkserver (``commgate.run.launcher.PRELOAD``): builds commgate's completion-stamps
extension once per environment and loads it (``commgate.run.stamps``), so that every rank inherits it. A
failed build is said on the forkserver's log and the poller stamps every call."""

from __future__ import annotations

from commgate.run import stamps

stamps.build()

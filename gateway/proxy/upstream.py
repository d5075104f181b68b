"""The `Upstream` seam now lives in `gateway.upstream.seam`; these names stay importable."""

from gateway.upstream.seam import RawHeaders, Timeouts, Upstream, UpstreamResponse

__all__ = ["RawHeaders", "Timeouts", "Upstream", "UpstreamResponse"]

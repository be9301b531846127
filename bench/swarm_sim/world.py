"""The world the simulated swarm lives in: GPUs, places, links, NAT, churn and requests.

Every number here is either a published figure (its source beside it) or an assumption, named
as one. docs/scale.md lists them; change one here and the whole simulation follows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


# -- GPUs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    #: peak memory bandwidth, GB/s (vendor datasheets)
    bandwidth_gbs: float
    #: dense FP16/BF16 tensor throughput, TFLOPS (vendor datasheets; without sparsity)
    tflops: float
    #: share of the swarm's peers (an assumption: mostly consumer cards, as rented on
    #: marketplaces such as vast.ai, with some datacenter cards)
    share: float
    datacenter: bool = False


GPUS = (
    # NVIDIA GeForce RTX 30/40/50 series and datacenter datasheets
    Gpu("RTX 3060 12GB", 12, 360, 51, 0.12),
    Gpu("RTX 3080 10GB", 10, 760, 119, 0.08),
    Gpu("RTX 3090", 24, 936, 142, 0.20),
    Gpu("RTX 4080", 16, 717, 195, 0.08),
    Gpu("RTX 4090", 24, 1008, 330, 0.22),
    Gpu("RTX 5090", 32, 1792, 419, 0.06),
    Gpu("RTX A6000", 48, 768, 155, 0.06, True),
    Gpu("L40S", 48, 864, 362, 0.06, True),
    Gpu("A100 80GB", 80, 2039, 312, 0.08, True),
    Gpu("H100 SXM", 80, 3350, 989, 0.04, True),
)
#: share of peak memory bandwidth decode kernels reach (gpt-fast and vLLM report 50-70% on
#: batch-1 decode; an assumption within that range)
BANDWIDTH_EFFICIENCY = 0.6
#: share of peak tensor throughput large batches reach (model FLOPs utilisation of serving
#: stacks; an assumption)
FLOPS_EFFICIENCY = 0.4
#: share of GPU memory a peer gives the KV cache (``--kv-budget-mb``; the rest of the 20% that
#: placement.MEMORY_USE leaves is activations and the runtime)
KV_SHARE = 0.15


# -- places --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class City:
    name: str
    lat: float
    lon: float
    #: share of peers (an assumption, loosely following where GPU owners and data centres are)
    share: float


CITIES = (
    City("San Francisco", 37.77, -122.42, 0.08), City("Los Angeles", 34.05, -118.24, 0.05),
    City("Seattle", 47.61, -122.33, 0.03), City("Dallas", 32.78, -96.80, 0.04),
    City("Chicago", 41.88, -87.63, 0.04), City("New York", 40.71, -74.01, 0.07),
    City("Ashburn", 39.04, -77.49, 0.05), City("Toronto", 43.65, -79.38, 0.03),
    City("Sao Paulo", -23.55, -46.63, 0.03), City("London", 51.51, -0.13, 0.06),
    City("Amsterdam", 52.37, 4.90, 0.04), City("Frankfurt", 50.11, 8.68, 0.05),
    City("Paris", 48.86, 2.35, 0.03), City("Stockholm", 59.33, 18.07, 0.02),
    City("Warsaw", 52.23, 21.01, 0.03), City("Moscow", 55.76, 37.62, 0.03),
    City("Istanbul", 41.01, 28.98, 0.02), City("Dubai", 25.20, 55.27, 0.01),
    City("Mumbai", 19.08, 72.88, 0.03), City("Bangalore", 12.97, 77.59, 0.02),
    City("Singapore", 1.35, 103.82, 0.03), City("Hong Kong", 22.32, 114.17, 0.02),
    City("Shanghai", 31.23, 121.47, 0.04), City("Beijing", 39.90, 116.40, 0.03),
    City("Seoul", 37.57, 126.98, 0.03), City("Tokyo", 35.68, 139.69, 0.04),
    City("Sydney", -33.87, 151.21, 0.02), City("Johannesburg", -26.20, 28.05, 0.01),
)
#: light in fiber: c / 1.47 (refractive index of silica fiber)
FIBER_KM_PER_S = 204_000.0
#: how much longer internet paths are than the great circle, and slower for it: Singla et al.,
#: "The Internet at the Speed of Light" (HotNets 2014) measured a median RTT ~3x the c-latency,
#: of which 1.47 is fiber's refractive index; the rest (~2x) is path stretch and routing
PATH_STRETCH = 2.0
#: one-way access latency of a home line and of a data centre (s): FCC Measuring Broadband
#: America (2023) reports 10-30 ms idle round trips on cable/DSL and under 10 ms on fiber
HOME_ACCESS_S = (0.003, 0.015)
DC_ACCESS_S = (0.0005, 0.001)


def great_circle_km(a: City, b: City) -> float:
    p1, p2 = math.radians(a.lat), math.radians(b.lat)
    dp, dl = p2 - p1, math.radians(b.lon - a.lon)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * 6371.0 * math.asin(min(1.0, math.sqrt(h)))


def path_rtt(a: City, b: City) -> float:
    """Round trip between two cities' networks (s), without the access lines."""
    return 2 * great_circle_km(a, b) * PATH_STRETCH / FIBER_KM_PER_S + 0.001


# -- NAT -----------------------------------------------------------------------------------------
#: share of home peers behind a NAT or firewall that blocks inbound connections (an assumption;
#: IPFS/libp2p network crawls find roughly two thirds of peers undialable)
HOME_NAT_SHARE = 0.65
#: share of hole punches that succeed: Trautwein et al., "Challenging Tribal Knowledge -- Large
#: Scale Measurement Campaign on Decentralized NAT Traversal" (2025): DCUtR 70% +- 7.1%
HOLE_PUNCH_SUCCESS = 0.70


# -- churn ---------------------------------------------------------------------------------------
#: Session lengths: Weibull, as Stutzbach & Rejaie, "Understanding Churn in Peer-to-Peer Networks"
#: (IMC 2006), found for Gnutella, Kad and BitTorrent (shape 0.34-0.59: heavy tailed, many
#: short sessions and a few very long ones). The medians are assumptions for GPU donors.
CHURN_SHAPE = 0.5
HOME_MEDIAN_S = 2 * 3600.0
DC_MEDIAN_S = 12 * 3600.0
#: share of joining peers that already hold the weights of the span they take (returning peers)
WEIGHTS_CACHED = 0.5
#: a peer's downlink when fetching weights from the swarm (MB/s): home lines of 100 Mbit/s to
#: 1 Gbit/s (Ookla Speedtest Global Index: median fixed download ~90-250 Mbit/s in the countries
#: above), data centres 10 Gbit/s; disk reads at 2 GB/s
HOME_DOWNLINK_MBS = (12.5, 125.0)
DC_DOWNLINK_MBS = 1250.0
DISK_MBS = 2000.0
#: share of departures that close connections (a process stopped) rather than vanish (a crash,
#: a cable, a laptop lid), which requests notice only by a timeout (an assumption)
GRACEFUL_SHARE = 0.5


def weibull_with_median(rng: random.Random, median: float, shape: float = CHURN_SHAPE) -> float:
    scale = median / math.log(2) ** (1 / shape)
    return rng.weibullvariate(scale, shape)


# -- requests ------------------------------------------------------------------------------------
#: Prompt and output lengths: lognormal around the medians of Azure's LLM inference trace for
#: conversation (Patel et al., "Splitwise", ISCA 2024: median prompt ~1020, output ~129 tokens)
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MAX = 1020, 1.0, 8192
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MAX = 129, 1.0, 2048
#: gateways (clients) where requests enter, one per city of this list (an assumption)
GATEWAY_CITIES = ("San Francisco", "New York", "London", "Frankfurt", "Singapore", "Tokyo", "Sao Paulo",
                  "Mumbai")


def prompt_and_output(rng: random.Random) -> tuple[int, int]:
    p = min(PROMPT_MAX, max(1, int(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA))))
    o = min(OUTPUT_MAX, max(1, int(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA))))
    return p, o


def mean_output() -> float:
    """Mean output length (lognormal mean; the cap barely matters at these parameters)."""
    return OUTPUT_MEDIAN * math.exp(OUTPUT_SIGMA ** 2 / 2)


def pick(rng: random.Random, items, weight=lambda x: x.share):
    return rng.choices(items, weights=[weight(x) for x in items])[0]


def city(name: str) -> City:
    return next(c for c in CITIES if c.name == name)

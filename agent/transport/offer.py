"""What the agent accepts as a WebRTC offer, checked before aiortc builds anything for it.

aiortc's own parser takes a lot that is not a usable offer: an SDP *answer* (its DTLS role is
decided already), twenty media sections (each would become a transceiver with its own
transport), an audio section whose codecs the agent cannot decode (the call would connect
and stay silent), a section with no certificate fingerprint (the call would never connect),
sections not bundled (aiortc bundles them in its answer all the same). Each of those is
refused here with a reason the client can act on.
"""

from __future__ import annotations

import re

from aiortc.codecs import CODECS
from aiortc.rtcdtlstransport import X509_DIGEST_ALGORITHMS
from aiortc.sdp import SessionDescription

# A browser offers audio, video and the data channel: 3. Room for a few more, not for abuse.
MAX_MEDIA_SECTIONS = 8
# The audio codecs aiortc can decode (opus, G722, PCMU, PCMA), by lower-case name.
_AUDIO_CODECS = {c.mimeType.split("/", 1)[1].lower() for c in CODECS["audio"]}
# A certificate fingerprint's value: hex byte pairs, colon-separated (RFC 8122).
_HEX_PAIRS = re.compile(r"[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2})+")


class OfferError(ValueError):
    """The body is not an offer the agent can answer; the message says why."""


def check_offer(sdp: str) -> None:
    """Raise OfferError unless `sdp` is an offer with one decodable audio section at least."""
    if sdp.count("\nm=") + sdp.startswith("m=") > MAX_MEDIA_SECTIONS:
        raise OfferError(f"too many media sections (at most {MAX_MEDIA_SECTIONS})")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:  # aiortc's parser raises whatever the line it chokes on causes
        raise OfferError(f"unparseable SDP ({type(exc).__name__}: {exc})") from None
    if not parsed.media:
        raise OfferError("no media sections: this is not an SDP offer")
    # An offerer must leave the DTLS role open (RFC 8842: a=setup:actpass); a fixed role
    # means the body is an answer to someone else's offer.
    roles = {m.dtls.role for m in parsed.media if m.dtls is not None}
    if roles - {"auto"}:
        raise OfferError(
            "an offer leaves the DTLS role open (a=setup:actpass, RFC 8842); a=setup:active or passive is an answer's"
        )
    # aiortc answers every section in one BUNDLE group, whatever the offer asked, and then runs
    # them all on the first one's transport: a peer that offered them unbundled (separate
    # transports) connects its audio, but its data channel never opens. Refused, saying so.
    bundled = {mid for g in parsed.group if g.semantic == "BUNDLE" for mid in g.items}
    if len(parsed.media) > 1 and any(m.rtp.muxId not in bundled for m in parsed.media):
        raise OfferError("the offer must bundle its media sections (a=group:BUNDLE naming every a=mid)")
    audio = [m for m in parsed.media if m.kind == "audio"]
    if not audio:
        raise OfferError("the offer has no audio: send the microphone")
    # Without a fingerprint aiortc can use, DTLS cannot be verified: the call would be answered
    # and never connect (aiortc asserts one exists after the answer, in a task of its own).
    for media in parsed.media:
        prints = media.dtls.fingerprints if media.dtls is not None else []
        if not any(_usable(f.algorithm, f.value) for f in prints):
            raise OfferError(
                f"a media section ({media.kind}) has no usable a=fingerprint "
                f"({', '.join(sorted(X509_DIGEST_ALGORITHMS))}, hex byte pairs)"
            )
    if not any(_decodable(m) for m in audio):
        raise OfferError(f"no audio codec the agent can decode (offer one of: {', '.join(sorted(_AUDIO_CODECS))})")


def _usable(algorithm: str, value: str) -> bool:
    return algorithm.lower() in X509_DIGEST_ALGORITHMS and _HEX_PAIRS.fullmatch(value) is not None


def _decodable(media) -> bool:
    named = {c.mimeType.split("/", 1)[-1].lower() for c in media.rtp.codecs}
    # Static payload types 0 (PCMU) and 8 (PCMA) need no rtpmap line.
    static = {"pcmu" for f in media.fmt if f == 0} | {"pcma" for f in media.fmt if f == 8}
    return bool((named | static) & _AUDIO_CODECS) and media.port != 0

// A js-libp2p peer for the interop suite, driven by JSON lines: commands on stdin, events and
// replies on stdout (one JSON object per line). Run with the polyfill:
//
//     node --import ./polyfill.js peer.js '{"listen": ["/ip4/127.0.0.1/tcp/0"]}'
//
// It speaks TCP + Noise + Yamux, identify, ping, gossipsub, Kademlia (/ipfs/kad/1.0.0), and
// echoes every stream opened on /shardnet/activation/1.0.0 back byte for byte. With "circuit" it
// also dials and listens on relayed addresses (listen: "<relay>/p2p-circuit" reserves there) and
// runs DCUtR, to turn relayed connections into direct ones ({"dcutr": false} leaves it out, so
// relayed connections stay relayed). Streams run on limited (relayed) connections too.
import { createInterface } from 'node:readline'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { gossipsub } from '@libp2p/gossipsub'
import { kadDHT, passthroughMapper } from '@libp2p/kad-dht'
import { circuitRelayServer, circuitRelayTransport } from '@libp2p/circuit-relay-v2'
import { dcutr } from '@libp2p/dcutr'
import { multiaddr } from '@multiformats/multiaddr'
import { peerIdFromString } from '@libp2p/peer-id'
import { CID } from 'multiformats/cid'
import * as Digest from 'multiformats/hashes/digest'

const opts = JSON.parse(process.argv[2] ?? '{}')
const ECHO = '/shardnet/activation/1.0.0'
const out = (obj) => process.stdout.write(JSON.stringify(obj) + '\n')
const b64 = (u8) => Buffer.from(u8).toString('base64')

const services = {}
if (opts.relay) {
  // a circuit relay v2 server with js-libp2p's default limits per circuit (2 minutes, 128 KiB)
  services.relay = circuitRelayServer({ reservations: { maxReservations: 16 } })
}

// AutoNAT v1 (client and server), as a js-libp2p app would enable it: {"autonat": true}
if (opts.autonat) {
  const { autoNAT } = await import('@libp2p/autonat')
  services.autonat = autoNAT()
}

const transports = [tcp()]
if (opts.circuit) {
  transports.push(circuitRelayTransport())
  // {"dcutr": false}: stay on the relay (the relay-role checks want every round to cross it)
  if (opts.dcutr !== false) services.dcutr = dcutr()
}

const node = await createLibp2p({
  // appendAnnounce: addresses to advertise besides the verified ones (js-libp2p advertises an
  // interface address only once AutoNAT confirms it; a public peer's operator states it instead)
  addresses: { listen: opts.listen ?? ['/ip4/127.0.0.1/tcp/0'], appendAnnounce: opts.announce ?? [] },
  // the suite runs on loopback and private lab addresses, which js-libp2p refuses to dial by default
  connectionGater: { denyDialMultiaddr: async () => false },
  transports,
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: {
    identify: identify(),
    ping: ping(),
    pubsub: gossipsub({ allowPublishToZeroTopicPeers: true, emitSelf: false }),
    // a DHT server on the standard protocol; shardnet's signed records live under /shardnet/
    // keys, which js-libp2p stores only for namespaces it has a validator for (it cannot check
    // shardnet's signatures, so it accepts them as they are and keeps the first it sees)
    dht: kadDHT({
      protocol: '/ipfs/kad/1.0.0',
      clientMode: false,
      // the Amino protocol ID makes js drop peers' private addresses, so a loopback peer would
      // never enter its routing table
      peerInfoMapper: passthroughMapper,
      validators: { shardnet: async () => {} },
      selectors: { shardnet: () => 0 }
    }),
    ...services
  }
})

await node.handle(ECHO, async (stream) => {
  // echo until the other side closes its write end, then close ours
  for await (const chunk of stream) {
    const bytes = chunk.subarray()
    if (!stream.send(bytes)) await stream.onDrain()
  }
  await stream.close()
}, { runOnLimitedConnection: true }) // relayed connections are "limited" when the relay says so

if (opts.autonat) {
  // every closed connection as an event: the AutoNAT check watches for a peer dropped after a question
  node.addEventListener('connection:close', (evt) => {
    out({ event: 'connection_closed', peer: evt.detail.remotePeer.toString(), remote: evt.detail.remoteAddr.toString() })
  })
}

node.services.pubsub.addEventListener('message', (evt) => {
  const m = evt.detail
  out({ event: 'message', topic: m.topic, from: m.from?.toString(), data: b64(m.data) })
})

const cidOf = (hex) => CID.createV1(0x55, Digest.decode(Buffer.from(hex, 'hex')))
const target = (cmd) => cmd.addr ? multiaddr(cmd.addr) : peerIdFromString(cmd.peer)

const commands = {
  async dial (cmd) {
    const conn = await node.dial(target(cmd))
    return { peer: conn.remotePeer.toString(), remote: conn.remoteAddr.toString() }
  },
  async ping (cmd) {
    return { rtt_ms: await node.services.ping.ping(target(cmd)) }
  },
  async peer_info (cmd) {
    const p = await node.peerStore.get(peerIdFromString(cmd.peer))
    return {
      protocols: p.protocols,
      addrs: p.addresses.map((a) => a.multiaddr.toString()),
      agent: p.metadata.get('AgentVersion') ? new TextDecoder().decode(p.metadata.get('AgentVersion')) : null,
      protocol_version: p.metadata.get('ProtocolVersion') ? new TextDecoder().decode(p.metadata.get('ProtocolVersion')) : null
    }
  },
  async conns () {
    return {
      conns: node.getConnections().map((c) => ({
        peer: c.remotePeer.toString(),
        remote: c.remoteAddr.toString(),
        direction: c.direction,
        limited: c.limits != null,
        id: c.id
      }))
    }
  },
  async hang_up (cmd) {
    await node.hangUp(target(cmd))
    return {}
  },
  async addrs () {
    return { addrs: node.getMultiaddrs().map((a) => a.toString()) }
  },
  async echo (cmd) {
    // open a stream on ECHO, send the bytes, read back as many, close
    const stream = await node.dialProtocol(target(cmd), cmd.protocol ?? ECHO, { runOnLimitedConnection: true })
    const data = Buffer.from(cmd.data, 'base64')
    if (!stream.send(data)) await stream.onDrain()
    const got = []
    let n = 0
    for await (const chunk of stream) {
      const bytes = chunk.subarray()
      got.push(bytes)
      n += bytes.length
      if (n >= data.length) break
    }
    // how the stream ended: "reset" or "aborted" when a relay cut the circuit under it
    const status = stream.status
    if (status === 'open') await stream.close()
    return { data: b64(Buffer.concat(got)), status }
  },
  async dht_put (cmd) {
    let responses = 0
    for await (const ev of node.services.dht.put(Buffer.from(cmd.key, 'base64'), Buffer.from(cmd.value, 'base64'))) {
      if (ev.name === 'PEER_RESPONSE') responses++
    }
    return { responses }
  },
  async dht_get (cmd) {
    // every value found, and from whom (ourselves: the local store), until the query ends
    const values = []
    const errors = []
    const signal = AbortSignal.timeout((cmd.seconds ?? 10) * 1000)
    try {
      for await (const ev of node.services.dht.get(Buffer.from(cmd.key, 'base64'), { signal })) {
        if (ev.name === 'VALUE') values.push({ from: ev.from.toString(), value: b64(ev.value) })
        if (ev.name === 'QUERY_ERROR') errors.push(`${ev.from}: ${ev.error?.message}`)
      }
    } catch (e) {
      errors.push(`${e.name}: ${e.message}`)
    }
    return { values, errors }
  },
  async provide (cmd) {
    await node.contentRouting.provide(cidOf(cmd.multihash))
    return {}
  },
  async find_providers (cmd) {
    const found = []
    const signal = AbortSignal.timeout((cmd.seconds ?? 10) * 1000)
    try {
      for await (const p of node.contentRouting.findProviders(cidOf(cmd.multihash), { signal })) {
        found.push({ peer: p.id.toString(), addrs: p.multiaddrs.map((a) => a.toString()) })
        if (found.length >= (cmd.count ?? 1)) break
      }
    } catch (e) {
      if (found.length === 0) throw e
    }
    return { providers: found }
  },
  async subscribe (cmd) {
    node.services.pubsub.subscribe(cmd.topic)
    return {}
  },
  async topic_peers (cmd) {
    return { peers: node.services.pubsub.getSubscribers(cmd.topic).map((p) => p.toString()) }
  },
  async publish (cmd) {
    const r = await node.services.pubsub.publish(cmd.topic, Buffer.from(cmd.data, 'base64'))
    return { recipients: r.recipients.map((p) => p.toString()) }
  },
  async stop () {
    await node.stop()
    setTimeout(() => process.exit(0), 10)
    return {}
  }
}

out({
  event: 'ready',
  peer_id: node.peerId.toString(),
  addrs: node.getMultiaddrs().map((a) => a.toString()),
  protocols: node.getProtocols()
})

const rl = createInterface({ input: process.stdin })
rl.on('line', async (line) => {
  let cmd
  try {
    cmd = JSON.parse(line)
  } catch (e) {
    out({ event: 'error', error: `not JSON: ${e.message}` })
    return
  }
  try {
    const fn = commands[cmd.cmd]
    if (!fn) throw new Error(`unknown command ${cmd.cmd}`)
    out({ event: 'result', id: cmd.id, ok: true, ...(await fn(cmd)) })
  } catch (e) {
    out({ event: 'result', id: cmd.id, ok: false, error: `${e.name}: ${e.message}` })
  }
})
rl.on('close', async () => {
  await node.stop()
  process.exit(0)
})

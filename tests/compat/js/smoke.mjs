// The npm `e2b` SDK, unchanged, against aenv. Configured only by E2B_API_KEY, E2B_API_URL and
// E2B_SANDBOX_URL. Prints one JSON line of observations; tests/compat/test_js_sdk.py checks them.
import { Sandbox, CommandExitError, NotFoundError } from 'e2b'

const seen = {}
const tag = `js-${process.pid}`
const sbx = await Sandbox.create({ timeoutMs: 300_000, metadata: { suite: tag }, envs: { FROM_JS: 'yes' } })
try {
  const chunks = []
  const run = await sbx.commands.run('echo "$FROM_JS $(whoami)"; echo err >&2', { onStdout: (d) => chunks.push(d) })
  seen.stdout = run.stdout
  seen.stderr = run.stderr
  seen.streamed = chunks.join('')
  try {
    await sbx.commands.run('exit 5')
  } catch (e) {
    seen.exitError = e instanceof CommandExitError ? e.exitCode : `wrong error: ${e}`
  }

  const bytes = new Uint8Array(2 * 1024 * 1024).map((_, i) => (i * 7) % 251)
  await sbx.files.write('/home/user/js/blob.bin', bytes.buffer)
  const back = await sbx.files.read('/home/user/js/blob.bin', { format: 'bytes' })
  seen.fileRoundTrip = back.length === bytes.length && back.every((b, i) => b === bytes[i])
  await sbx.files.write('/home/user/js/note.txt', 'from node')
  seen.listed = (await sbx.files.list('/home/user/js')).map((e) => e.name).sort()
  seen.note = await sbx.files.read('/home/user/js/note.txt')

  const bg = await sbx.commands.run('sleep 600', { background: true })
  seen.killedProcess = await sbx.commands.kill(bg.pid)

  const listed = await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems()
  seen.listedIds = listed.map((s) => s.sandboxId)

  seen.paused = await sbx.pause()
  seen.stateAfterPause = (await Sandbox.getInfo(sbx.sandboxId)).state
  const again = await Sandbox.connect(sbx.sandboxId)
  seen.stateAfterConnect = (await again.getInfo()).state
  seen.noteAfterResume = await again.files.read('/home/user/js/note.txt')
} finally {
  seen.killed = await Sandbox.kill(sbx.sandboxId)
}
seen.killedAgain = await Sandbox.kill(sbx.sandboxId)
try {
  await Sandbox.connect(sbx.sandboxId)
  seen.connectAfterKill = 'connected'
} catch (e) {
  seen.connectAfterKill = e instanceof NotFoundError ? 'NotFoundError' : `${e.constructor.name}: ${e.message}`
}
seen.sandboxId = sbx.sandboxId
console.log(JSON.stringify(seen))

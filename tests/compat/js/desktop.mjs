// E2B's npm Desktop SDK, unchanged, against aenv's `desktop` template (tests/desktop/test_desktop_js.py).
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY name the node; one JSON line of what was seen.
import { Sandbox } from '@e2b/desktop'

const desktop = await Sandbox.create({ timeoutMs: 300_000 })
const seen = { sandboxId: desktop.sandboxId }
try {
  seen.size = await desktop.getScreenSize()
  seen.cursor = await desktop.getCursorPosition()
  await desktop.moveMouse(100, 200)
  seen.moved = await desktop.getCursorPosition()
  const shot = await desktop.screenshot()
  seen.png = Buffer.from(shot.subarray(0, 8)).toString('hex')
  await desktop.files.write('/home/user/testfile.txt', 'This is a test file.\n')
  await desktop.open('/home/user/testfile.txt')
  await desktop.stream.start({ requireAuth: true })
  seen.url = desktop.stream.getUrl({ authKey: desktop.stream.getAuthKey() })
  await desktop.stream.stop()
} finally {
  await desktop.kill()
}
console.log(JSON.stringify(seen))

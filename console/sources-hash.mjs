// sha256 over the console's sources (path NUL content NUL, paths sorted). `--write` records it in the
// bundle (SOURCES.sha256); the Python test recomputes it the same way, so a source edited without a
// rebuild fails the tests. Keep in step with polychip/console/sources.py.
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join, relative } from 'node:path';

const ROOT = new URL('.', import.meta.url).pathname;
const FILES = ['index.html', 'package.json', 'package-lock.json', 'vite.config.js', 'sources-hash.mjs'];

function walk(dir) {
  return readdirSync(dir).flatMap((name) => {
    const p = join(dir, name);
    return statSync(p).isDirectory() ? walk(p) : [p];
  });
}

const paths = [...FILES.map((f) => join(ROOT, f)), ...walk(join(ROOT, 'src')), ...walk(join(ROOT, 'public'))]
  .map((p) => relative(ROOT, p).split('\\').join('/')).sort();
const hash = createHash('sha256');
for (const p of paths) {
  hash.update(p + '\0');
  hash.update(readFileSync(join(ROOT, p)));
  hash.update('\0');
}
const digest = hash.digest('hex');
if (process.argv.includes('--write')) {
  writeFileSync(join(ROOT, '../polychip/console/static/SOURCES.sha256'), digest + '\n');
}
console.log(digest);

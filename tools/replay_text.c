// replay_text.c: what `mtrl replay` prints of bytes and tokens, and where the files a run store
// names are (see replay.h). Shared by the episode view (cmd_replay.c) and the rescoring and
// re-execution (replay_model.c).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/image.h"
#include "common/tokenizer.h"
#include "tools/replay.h"

// (replay.h)
size_t replay_utf8_len(const uint8_t *b, size_t n) {
    uint8_t c = b[0];
    size_t len;
    uint8_t lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;
    } else return 0;
    if (n < len) return 0;
    if (b[1] < lo || b[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (b[i] < 0x80 || b[i] > 0xbf) return 0;
    return len;
}

void replay_put_escaped(FILE *f, const uint8_t *b, size_t n, replay_ascii_fn ascii, const void *u,
                        const char *invalid_fmt) {
    char esc[16];
    for (size_t i = 0; i < n;) {
        uint8_t c = b[i];
        if (c < 0x80) {
            const char *e = ascii(c, esc, u);
            if (e) fputs(e, f);
            else fputc(c, f);
            i++;
            continue;
        }
        size_t len = replay_utf8_len(b + i, n - i);
        if (len) {
            fwrite(b + i, 1, len, f);
            i += len;
        } else {
            fprintf(f, invalid_fmt, c);
            i++;
        }
    }
}

// The text view's ASCII: newlines and tabs as they are (or escaped: *(int *)u), other control
// bytes as \xNN.
static const char *text_ascii_(uint8_t c, char *buf, const void *u) {
    int escape_ws = *(const int *)u;
    if ((c == '\n' || c == '\t') && !escape_ws) return NULL;
    if (c == '\n') return "\\n";
    if (c == '\t') return "\\t";
    if (c < 0x20 || c == 0x7f) {
        snprintf(buf, 16, "\\x%02x", c);
        return buf;
    }
    return NULL;
}

void replay_put_bytes(FILE *f, const uint8_t *b, size_t n, int escape_ws) {
    replay_put_escaped(f, b, n, text_ascii_, &escape_ws, "\\x%02x");
}

// The command's one tokenizer (replay_text_use): what the run's ids mean.
static const mtrl_tokenizer *tok_;

void replay_text_use(const mtrl_tokenizer *tok) { tok_ = tok; }

// A BPE id's bytes (0), a special's text (1), or none (-1), into piece (cap bytes).
static int piece_(uint32_t id, char *piece, size_t cap, size_t *len) {
    int special;
    *len = mtrl_tokenizer_piece(tok_, id, piece, cap, &special);
    if (*len >= cap) *len = cap - 1;
    return special;
}

void replay_put_ids(FILE *f, const uint32_t *ids, size_t n, int colour, int escape_ws) {
    if (tok_ && !mtrl_tokenizer_is_bytes(tok_)) {
        // A BPE run: each id's bytes, gathered so that UTF-8 split across ids shows whole.
        uint8_t buf[1024];
        size_t nb = 0;
        for (size_t i = 0; i <= n; i++) {
            char piece[256];
            size_t len = 0;
            int kind = i < n && !mtrl_img_token_is(ids[i]) ? piece_(ids[i], piece, sizeof piece, &len) : -1;
            if (kind == 0 && nb + len <= sizeof buf) {
                memcpy(buf + nb, piece, len);
                nb += len;
                continue;
            }
            if (nb) replay_put_bytes(f, buf, nb, escape_ws);
            nb = 0;
            if (i == n) break;
            if (kind == 0) { // buffer was full
                memcpy(buf, piece, len);
                nb = len;
                continue;
            }
            if (colour) fputs("\033[2m", f);
            if (kind == 1) fputs(piece, f);
            else fprintf(f, "<|id %u|>", ids[i]);
            if (colour) fputs("\033[22m", f);
        }
        return;
    }
    uint8_t buf[256];
    size_t nb = 0;
    for (size_t i = 0; i <= n; i++) {
        int is_byte = i < n && ids[i] < 256;
        if (is_byte && nb < sizeof buf) {
            buf[nb++] = (uint8_t)ids[i];
            continue;
        }
        if (nb) {
            replay_put_bytes(f, buf, nb, escape_ws);
            nb = 0;
        }
        if (i == n) break;
        if (is_byte) { // buffer was full
            buf[nb++] = (uint8_t)ids[i];
            continue;
        }
        const char *name = mtrl_tok_special_name(ids[i]);
        if (colour) fputs("\033[2m", f);
        if (ids[i] == MTRL_IMG_START) { // a picture's tokens as one: its grid and patch rows
            size_t j = i + 1, rows = 0, patches = 0;
            uint32_t first = UINT32_MAX;
            for (; j < n && ids[j] != MTRL_IMG_END && mtrl_img_token_is(ids[j]); j++) {
                if (ids[j] == MTRL_IMG_ROW) rows++;
                else if (mtrl_img_token_is_patch(ids[j])) {
                    if (first == UINT32_MAX) first = mtrl_img_patch_row(ids[j]);
                    patches++;
                }
            }
            fprintf(f, "<|picture %zu x %zu patches, rows %u..%zu|>", rows, rows ? patches / rows : 0,
                    first == UINT32_MAX ? 0 : first, first == UINT32_MAX ? 0 : first + patches - 1);
            i = j < n && ids[j] == MTRL_IMG_END ? j : j - 1;
        } else if (name) fputs(name, f);
        else if (mtrl_img_token_is(ids[i])) fprintf(f, "<|image %#x|>", ids[i]);
        else fprintf(f, "<|id %u|>", ids[i]);
        if (colour) fputs("\033[22m", f); // normal intensity: the caller's colour goes on
    }
}

void replay_token_text(uint32_t id, char *out, size_t cap) {
    if (tok_ && !mtrl_tokenizer_is_bytes(tok_) && !mtrl_img_token_is(id)) {
        char piece[64];
        size_t len;
        int kind = piece_(id, piece, sizeof piece, &len);
        if (kind < 0) snprintf(out, cap, "<|id %u|>", id);
        else {
            // one token's bytes, escaped as the text view escapes them
            char *buf = NULL;
            size_t blen = 0;
            FILE *m = open_memstream(&buf, &blen);
            if (kind == 1) fputs(piece, m);
            else replay_put_bytes(m, (const uint8_t *)piece, len, 1);
            fclose(m);
            snprintf(out, cap, "%s", buf ? buf : "");
            free(buf);
        }
        return;
    }
    const char *name = mtrl_tok_special_name(id);
    if (name) snprintf(out, cap, "%s", name);
    else if (id == MTRL_IMG_START) snprintf(out, cap, "<|picture|>");
    else if (id == MTRL_IMG_ROW) snprintf(out, cap, "<|picture row|>");
    else if (id == MTRL_IMG_END) snprintf(out, cap, "<|/picture|>");
    else if (mtrl_img_token_is_patch(id)) snprintf(out, cap, "<|patch %u|>", mtrl_img_patch_row(id));
    else if (id >= 256) snprintf(out, cap, "<|id %u|>", id);
    else if (id == '\n') snprintf(out, cap, "\\n");
    else if (id == '\t') snprintf(out, cap, "\\t");
    else if (id < 0x20 || id == 0x7f || id >= 0x80) snprintf(out, cap, "\\x%02x", id);
    else snprintf(out, cap, "%c", (char)id);
}

void replay_resolve_path(const char *db, const char *stored, char *out, size_t cap) {
    // Absolute: as stored. Relative (a run started with a relative out_dir): relative to the
    // directory of the database first (the learner's working directory when it was given a
    // relative --db, and what survives moving a run's directory), else to ours.
    snprintf(out, cap, "%s", stored);
    if (!stored[0] || stored[0] == '/') return;
    const char *slash = strrchr(db, '/');
    if (!slash) return;
    char cand[8192];
    snprintf(cand, sizeof cand, "%.*s/%s", (int)(slash - db), db, stored);
    if (access(cand, F_OK) == 0 || access(stored, F_OK) != 0) snprintf(out, cap, "%s", cand);
}

// mtrl-test: cpu
// Tokenizer: every byte round-trips, specials render by name and are dropped from tool bytes.
#include "common/tokenizer.h"
#include "tests/testhelp.h"

int main(void) {
    unsigned char all[256];
    for (int i = 0; i < 256; i++) all[i] = (unsigned char)(255 - i);
    uint32_t ids[300];
    TEST_EQ_INT(mtrl_tok_encode(all, 256, ids), 256);
    char back[300];
    TEST_EQ_INT(mtrl_tok_bytes(ids, 256, back, sizeof back), 256);
    TEST_CHECK(memcmp(back, all, 255) == 0); // last byte is 0, which is also the terminator
    const char *text = "What is 3+4? calc(3+4)";
    size_t n = mtrl_tok_encode(text, strlen(text), ids + 1);
    ids[0] = MTRL_TOK_BOS;
    ids[n + 1] = MTRL_TOK_TOOL_OPEN;
    ids[n + 2] = MTRL_TOK_EOS;
    char out[128];
    size_t len = mtrl_tok_decode(ids, n + 3, out, sizeof out);
    TEST_EQ_STR(out, "<|bos|>What is 3+4? calc(3+4)<|tool|><|eos|>");
    TEST_EQ_INT(len, strlen(out));
    mtrl_tok_bytes(ids, n + 3, out, sizeof out);
    TEST_EQ_STR(out, text);
    // truncation is snprintf-like: the full length is returned, the buffer stays terminated
    char small[8];
    TEST_EQ_INT(mtrl_tok_decode(ids, n + 3, small, sizeof small), len);
    TEST_EQ_INT(strlen(small), 7);
    TEST_CHECK(mtrl_tok_special_name(65) == NULL);
    TEST_CHECK(mtrl_tok_special_name(MTRL_VOCAB) == NULL);
    TEST_EQ_STR(mtrl_tok_special_name(MTRL_TOK_RESULT_CLOSE), "<|/result|>");
    return test_report();
}

// placeholder until the front door lands
#include <stdio.h>
int main(void) { fputs("mtrl: not built yet\n", stderr); return 2; }
